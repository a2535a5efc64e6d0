"""Per-layer depth-mixing statistics every ``logger.depth_stats_interval`` steps: one no-grad
forward with a ``stats`` dict, heatmaps written as PNG files, and the statistics handed to
the loggers that take them (:class:`~depthmix.pretrain.callbacks.wandb.WandbLogger`).

Mixers record with ``ctx.record("<name>", tensor)`` (key ``layer<u>/<name>``, ``u`` the
unrolled layer). :func:`collect` runs the forward on every rank (it goes through the
pipeline schedule, so it is collective), gathers what the stages and TP ranks recorded, and
returns it on the logging rank. :func:`summarise` turns it into, per ``<name>``, a
``[layers, sources]`` matrix (each recorded tensor reduced to its last dimension by
averaging the leading ones; shorter rows padded with NaN) and scalars:

* ``depth/<name>/layer<u>`` for 0-d records;
* ``depth/<name>/entropy/layer<u>`` (natural log; of the row renormalised to sum 1, when
  non-negative) and ``depth/<name>/max/layer<u>`` for vector records, plus their means.

Each matrix is drawn (:func:`render`: matplotlib's viridis, rows layers, columns sources,
NaN grey) and written by Pillow to ``<output_dir>/depth_stats/<name>/step_<k>.png``. A
vanilla model records nothing; then nothing is written or logged.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from depthmix.pretrain.callbacks.base import Callback

_KEY = re.compile(r"^layer(\d+)/(.+)$")


@dataclass
class DepthStats:
    """One statistics forward, on the logging rank."""

    step: int
    matrices: Dict[str, np.ndarray]
    """``[layers, sources]`` per recorded name."""
    scalars: Dict[str, float]
    images: Dict[str, np.ndarray]
    """The heatmap of each matrix, ``[h, w, 3]`` uint8."""


class DepthStatsCallback(Callback):
    """Collective: every rank runs the statistics forward; the logging rank writes the PNGs
    and calls ``log_depth_stats(trainer, stats)`` of each of ``consumers``."""

    def __init__(self, consumers: Sequence = ()):
        self.consumers = list(consumers)

    def post_step(self, trainer, result) -> None:
        interval = trainer.run.logger.depth_stats_interval
        if not interval or trainer.step % interval:
            return
        recorded = collect(trainer)
        if not recorded:  # other ranks, or a mixer that records nothing (vanilla)
            return
        from PIL import Image

        matrices, scalars = summarise(recorded)
        stats = DepthStats(trainer.step, matrices, scalars,
                           {name: render(matrix) for name, matrix in matrices.items()})
        for name, image in stats.images.items():
            directory = os.path.join(trainer.run.output_dir, "depth_stats",
                                     name.replace("/", "_"))
            os.makedirs(directory, exist_ok=True)
            Image.fromarray(image).save(os.path.join(directory, f"step_{trainer.step:07d}.png"))
        for consumer in self.consumers:
            consumer.log_depth_stats(trainer, stats)


# ---------------------------------------------------------------------------------------
# The statistics
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def collect(trainer) -> Optional[Dict[str, torch.Tensor]]:
    """Collective. Returns ``{"layer<u>/<name>": tensor}`` on the logging rank, else None.
    Records of the same key from several TP ranks are averaged when their shapes match
    (per-source averages over local heads), else concatenated along dim 0."""
    from megatron.core import parallel_state

    from depthmix.pretrain.step import run_schedule, take

    model = trainer.model
    n = 1 if trainer.topo.vp == 1 else trainer.topo.pp
    batches = take(trainer.data.valid_iterator(), n)
    stats: Dict[str, torch.Tensor] = {}
    for chunk in model:
        chunk.eval()
    try:
        run_schedule(model, batches, trainer.run.model.seq_length, forward_only=True,
                     stats=stats)
    finally:
        for chunk in model:
            chunk.train()
    mine = {k: v.detach().float().cpu() for k, v in stats.items()}
    if parallel_state.get_data_parallel_rank() != 0:
        mine = {}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if not trainer.topo.is_logging_rank:
        return None
    grouped = defaultdict(list)
    for part in everyone:
        for key, value in part.items():
            grouped[key].append(value)
    merged = {}
    for key, values in grouped.items():
        if all(v.shape == values[0].shape for v in values):
            merged[key] = torch.stack(values).mean(0)
        else:
            merged[key] = torch.cat([v.reshape(-1, v.shape[-1]) if v.dim() else v.reshape(1)
                                     for v in values])
    return merged


def summarise(stats: Dict[str, torch.Tensor]) -> Tuple[Dict[str, np.ndarray], Dict[str, float]]:
    """``({name: [layers, sources] matrix}, {scalar name: value})``; see module doc."""
    rows = defaultdict(dict)
    scalars: Dict[str, float] = {}
    for key, value in stats.items():
        m = _KEY.match(key)
        if m is None:
            continue
        layer, name = int(m.group(1)), m.group(2)
        value = value.double()
        if value.dim() == 0:
            scalars[f"depth/{name}/layer{layer}"] = float(value)
            continue
        vec = value.reshape(-1, value.shape[-1]).mean(0).numpy()
        rows[name][layer] = vec
    matrices = {}
    for name, by_layer in rows.items():
        layers = sorted(by_layer)
        width = max(len(by_layer[u]) for u in layers)
        mat = np.full((layers[-1] + 1, width), np.nan)
        entropies, maxima = [], []
        for u in layers:
            vec = by_layer[u]
            mat[u, :len(vec)] = vec
            maxima.append(float(np.max(vec)))
            scalars[f"depth/{name}/max/layer{u}"] = maxima[-1]
            total = vec.sum()
            if (vec >= 0).all() and total > 0:
                p = vec / total
                entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
                entropies.append(entropy)
                scalars[f"depth/{name}/entropy/layer{u}"] = entropy
        if entropies:
            scalars[f"depth/{name}/entropy/mean"] = float(np.mean(entropies))
        scalars[f"depth/{name}/max/mean"] = float(np.mean(maxima))
        matrices[name] = mat
    return matrices, scalars


# ---------------------------------------------------------------------------------------
# Heatmaps: a numpy matrix -> colour-mapped RGB
# ---------------------------------------------------------------------------------------

MISSING = (235, 235, 235)
"""The colour of NaN cells (no such source), light grey."""


def colormap(values: np.ndarray, vmin: float, vmax: float) -> np.ndarray:
    """``[..]`` floats -> ``[.., 3]`` uint8 through matplotlib's viridis over
    ``[vmin, vmax]`` (clipped); NaN -> :data:`MISSING`."""
    from matplotlib import colormaps, colors

    cmap = colormaps["viridis"].with_extremes(bad=np.array(MISSING) / 255)
    norm = colors.Normalize(vmin, vmax, clip=True)
    return cmap(norm(np.asarray(values, dtype=np.float64)), bytes=True)[..., :3]


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
