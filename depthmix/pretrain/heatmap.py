"""Heatmaps as PNG without matplotlib or PIL: a numpy matrix -> colour-mapped RGB -> PNG.

Used for the per-layer depth-weight statistics (rows: layers, columns: sources).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

# viridis at 9 evenly spaced points (RGB 0-255), interpolated linearly in between
_VIRIDIS = np.array([
    [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
    [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37],
], dtype=np.float64)
_MISSING = np.array([235, 235, 235], dtype=np.float64)  # NaN cells (no such source)


def colormap(values: np.ndarray, vmin: float, vmax: float) -> np.ndarray:
    """``[..]`` floats -> ``[.., 3]`` uint8 viridis; NaN -> light grey."""
    values = np.asarray(values, dtype=np.float64)
    span = vmax - vmin if vmax > vmin else 1.0
    x = np.clip((np.nan_to_num(values, nan=vmin) - vmin) / span, 0.0, 1.0)
    pos = x * (len(_VIRIDIS) - 1)
    lo = np.floor(pos).astype(int).clip(0, len(_VIRIDIS) - 2)
    frac = (pos - lo)[..., None]
    rgb = _VIRIDIS[lo] * (1 - frac) + _VIRIDIS[lo + 1] * frac
    rgb[np.isnan(values)] = _MISSING
    return rgb.round().astype(np.uint8)


def render(matrix: np.ndarray, cell: int = 12, vmin: float = None, vmax: float = None
           ) -> np.ndarray:
    """``[rows, cols]`` -> ``[rows*cell, cols*cell, 3]`` uint8 image (row 0 at the top),
    with a 1-pixel white grid between cells."""
    m = np.asarray(matrix, dtype=np.float64)
    finite = m[np.isfinite(m)]
    vmin = float(finite.min()) if vmin is None and finite.size else (vmin or 0.0)
    vmax = float(finite.max()) if vmax is None and finite.size else (vmax or 1.0)
    rgb = colormap(m, vmin, vmax)
    image = np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1)
    if cell > 3:
        image[cell - 1::cell, :, :] = 255
        image[:, cell - 1::cell, :] = 255
    return image


def png_bytes(image: np.ndarray) -> bytes:
    """``[h, w, 3]`` (RGB) or ``[h, w]`` (grey) uint8 -> PNG file contents."""
    image = np.ascontiguousarray(image, dtype=np.uint8)
    if image.ndim == 2:
        height, width = image.shape
        colour_type = 0
    elif image.ndim == 3 and image.shape[2] == 3:
        height, width, _ = image.shape
        colour_type = 2
    else:
        raise ValueError(f"expected [h, w] or [h, w, 3], got {image.shape}")
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))  # filter: none

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def read_png(data: bytes) -> np.ndarray:
    """Decode what :func:`png_bytes` writes (8-bit, filter 0); for tests."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour_type = header[:4]
    channels = {0: 1, 2: 3}[colour_type]
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * channels)
    assert (raw[:, 0] == 0).all(), "only filter type 0 is supported"
    pixels = raw[:, 1:].reshape(height, width, channels)
    return pixels[..., 0] if channels == 1 else pixels
