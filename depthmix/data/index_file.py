"""Megatron's ``.bin/.idx`` token files: written by :class:`TokenFileWriter`, checked whole
and self-consistent by :func:`check_prefix`, both from the format below.

:func:`check_prefix` reads the ``.idx`` of Megatron-Core's ``IndexedDataset`` (the
``MMapIndexedDataset`` format) directly, so it needs neither Megatron nor a process group
and can run before anything is built::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        token dtype code (Megatron's ``DType``: 1 uint8 ... 8 uint16)
    u64       S, the number of sequences
    u64       D, the number of document boundaries (documents + 1)
    i32[S]    sequence lengths in tokens
    i64[S]    sequence byte offsets into the .bin
    i64[D]    document boundaries (sequence indices; 0 first, S last)
    [i8[S]    sequence modes, multimodal datasets only]

The ``.bin`` is the tokens of all sequences back to back, so its length must be exactly
``sum(lengths) * itemsize``. A wrong pair (an ``.idx`` from another dataset), a truncated
copy or an empty dataset is refused with a :class:`ConfigError` that names the option,
the prefix and the numbers that disagree.
"""

from __future__ import annotations

import array
import os
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np

from depthmix.config.schema import ConfigError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype 1 + sequence count 8 + document count 8

DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
                           5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
"""Megatron-Core's ``indexed_dataset.DType`` codes."""

SCAN_CHUNK = 1 << 22
"""Sequences per numpy pass in the deep check (bounds memory on billion-token indices)."""
FULL_TOKEN_SCAN_BYTES = 8 << 20
"""A ``.bin`` up to this size has every token id checked against the vocabulary."""
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 16, 64 << 10
"""A larger one has this many evenly spaced blocks read (1 MiB per prefix)."""


@dataclass(frozen=True)
class PrefixInfo:
    """What :func:`check_prefix` found in a consistent prefix."""

    prefix: str
    dtype: np.dtype
    sequences: int
    documents: int
    tokens: int
    bin_bytes: int
    max_token_id: Optional[int] = None
    """Largest token id read (all of them for a small ``.bin``, else a sample); None when
    no vocabulary size was given."""


def check_prefix(prefix: str, option: str, vocab_size: Optional[int] = None, *,
                 deep: bool = True, vocab_source: Optional[str] = None) -> PrefixInfo:
    """Check ``prefix.bin``/``prefix.idx``; raise :class:`ConfigError` naming ``option``.

    Always (constant time): both files exist, the header's magic, version and dtype are
    known, the ``.idx`` length matches its counts, there is at least one document, the first
    and last document boundaries are ``0`` and ``S``, and the last sequence ends exactly at
    the end of the ``.bin``. With ``deep`` (one pass over the ``.idx``): every length is
    non-negative, every offset is the running sum of the lengths before it, the document
    boundaries never decrease, and ``sum(lengths) * itemsize`` equals the ``.bin`` length;
    with ``vocab_size``, token ids (all of a small ``.bin``, else 16 x 64 KiB spread over
    it) lie in ``[0, vocab_size)``. ``vocab_source`` names where ``vocab_size`` comes from
    in that message (e.g. ``data.tokenizer``).
    """
    name = os.path.basename(prefix)

    def fail(msg: str) -> ConfigError:
        return ConfigError(f"{option}={prefix}: {msg}")

    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    missing = [p for p in (bin_path, idx_path) if not os.path.isfile(p)]
    if missing:
        what = " and ".join(os.path.basename(p) for p in missing)
        raise fail(f"{what} not found (make {name}.bin/.idx with depthmix-preprocess)")
    bin_bytes, idx_bytes = os.path.getsize(bin_path), os.path.getsize(idx_path)

    with open(idx_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != INDEX_MAGIC:
        raise fail(f"{name}.idx is not a Megatron index file (its first bytes are not "
                   f"{INDEX_MAGIC!r})")
    version = int.from_bytes(head[9:17], "little")
    if version != INDEX_VERSION:
        raise fail(f"{name}.idx has index version {version}; only {INDEX_VERSION} is known")
    code = head[17]
    if code not in DTYPES:
        raise fail(f"{name}.idx has token dtype code {code}; known codes are "
                   f"{sorted(DTYPES)}")
    dtype = np.dtype(DTYPES[code])
    seqs = int.from_bytes(head[18:26], "little")
    bounds = int.from_bytes(head[26:34], "little")
    plain = HEADER_BYTES + 12 * seqs + 8 * bounds
    if idx_bytes not in (plain, plain + seqs):  # + one mode byte per sequence if multimodal
        raise fail(f"{name}.idx has {idx_bytes} bytes, its header ({seqs} sequences, "
                   f"{bounds} document boundaries) describes {plain} (truncated or damaged)")
    if seqs == 0 or bounds < 2:
        raise fail(f"empty dataset: {name}.idx lists no documents ({name}.bin has "
                   f"{bin_bytes} bytes)")

    idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(idx, np.int32, seqs, HEADER_BYTES)
    pointers = np.frombuffer(idx, np.int64, seqs, HEADER_BYTES + 4 * seqs)
    documents = np.frombuffer(idx, np.int64, bounds, HEADER_BYTES + 12 * seqs)
    if documents[0] != 0 or documents[-1] != seqs:
        raise fail(f"{name}.idx: document boundaries run from {documents[0]} to "
                   f"{documents[-1]}, not 0 to its {seqs} sequences (damaged index)")
    if deep:
        described = _sum(lengths) * dtype.itemsize
    else:
        described = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize
    if described != bin_bytes:
        raise fail(f"{name}.bin has {bin_bytes} bytes, {name}.idx describes {described} "
                   f"({described // dtype.itemsize} {dtype.name} tokens): a truncated copy, "
                   "or the two files come from different datasets")
    tokens = bin_bytes // dtype.itemsize
    if tokens == 0:
        raise fail(f"empty dataset: the {seqs} sequences of {name}.idx hold no tokens")
    if deep:
        bad = _first_bad_sequence(lengths, pointers, dtype.itemsize)
        if bad is not None:
            raise fail(f"{name}.idx: sequence {bad} has length {int(lengths[bad])} at byte "
                       f"offset {int(pointers[bad])}, inconsistent with the sequences before "
                       "it (damaged index)")
        if np.any(np.diff(documents) < 0):
            raise fail(f"{name}.idx: document boundaries decrease (damaged index)")

    max_id = None
    if vocab_size is not None and dtype.kind in "iu":
        low, max_id = _token_range(bin_path, dtype, bin_bytes)
        source = f" of {vocab_source}" if vocab_source else ""
        if low < 0 or max_id >= vocab_size:
            bad_id = low if low < 0 else max_id
            raise fail(f"{name}.bin holds token id {bad_id}, outside the {vocab_size}-token "
                       f"vocabulary{source} (tokenised with another tokenizer?)")
    return PrefixInfo(prefix=prefix, dtype=dtype, sequences=seqs, documents=bounds - 1,
                      tokens=tokens, bin_bytes=bin_bytes, max_token_id=max_id)


def _sum(lengths: np.ndarray) -> int:
    return sum(int(lengths[i:i + SCAN_CHUNK].sum(dtype=np.int64))
               for i in range(0, len(lengths), SCAN_CHUNK))


def _first_bad_sequence(lengths: np.ndarray, pointers: np.ndarray, itemsize: int
                        ) -> Optional[int]:
    """Index of the first negative length or offset that is not the running byte sum."""
    offset = 0
    for i in range(0, len(lengths), SCAN_CHUNK):
        n = lengths[i:i + SCAN_CHUNK].astype(np.int64)
        expect = offset + np.concatenate(([0], np.cumsum(n[:-1] * itemsize)))
        wrong = np.flatnonzero((n < 0) | (pointers[i:i + SCAN_CHUNK] != expect))
        if wrong.size:
            return i + int(wrong[0])
        offset = int(expect[-1] + n[-1] * itemsize)
    return None


def _token_range(bin_path: str, dtype: np.dtype, bin_bytes: int) -> tuple[int, int]:
    """(min, max) token id over the whole ``.bin`` when small, else over a spread sample."""
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    if bin_bytes <= FULL_TOKEN_SCAN_BYTES:
        return int(tokens.min()), int(tokens.max())
    per_block = SAMPLE_BLOCK_BYTES // dtype.itemsize
    starts = np.linspace(0, len(tokens) - per_block, SAMPLE_BLOCKS).astype(np.int64)
    blocks = [np.asarray(tokens[s:s + per_block]) for s in starts]
    return min(int(b.min()) for b in blocks), max(int(b.max()) for b in blocks)


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (vocab <= 65536), else int32 (as Megatron reads them)."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


class TokenFileWriter:
    """Writes a ``.bin/.idx`` pair in Megatron-Core's ``IndexedDataset`` format, one
    sequence per document, as its ``IndexedDatasetBuilder`` does (``add_document`` with one
    length, then ``finalize``); lengths are kept as int32, 4 bytes per document."""

    def __init__(self, bin_path: str, dtype: type):
        self.dtype = np.dtype(dtype)
        self.code = next(c for c, t in DTYPES.items() if np.dtype(t) == self.dtype)
        self.data_file = open(bin_path, "wb")
        self.lengths = array.array("i")

    def add_document(self, tokens: np.ndarray) -> None:
        self.data_file.write(np.asarray(tokens, dtype=self.dtype).tobytes())
        self.lengths.append(len(tokens))

    def close(self) -> None:
        self.data_file.close()

    def finalize(self, idx_path: str) -> None:
        self.close()
        lengths = np.frombuffer(self.lengths, dtype=np.int32)
        count = len(lengths)
        pointers = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(INDEX_MAGIC + struct.pack("<QBQQ", INDEX_VERSION, self.code, count,
                                              count + 1))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.arange(count + 1, dtype=np.int64).tobytes())  # document boundaries
