"""Per-layer depth-mixing statistics: one no-grad forward with a ``stats`` dict.

Mixers record with ``ctx.record("<name>", tensor)`` (key ``layer<u>/<name>``, ``u`` the
unrolled layer). :func:`collect` runs the forward on every rank (it goes through the
pipeline schedule, so it is collective), gathers what the stages and TP ranks recorded, and
returns it on the logging rank. :func:`summarise` turns it into, per ``<name>``, a
``[layers, sources]`` matrix (each recorded tensor reduced to its last dimension by
averaging the leading ones; shorter rows padded with NaN) and scalars:

* ``depth/<name>/layer<u>`` for 0-d records;
* ``depth/<name>/entropy/layer<u>`` (natural log; of the row renormalised to sum 1, when
  non-negative) and ``depth/<name>/max/layer<u>`` for vector records, plus their means.

A vanilla model records nothing; then nothing is logged.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

_KEY = re.compile(r"^layer(\d+)/(.+)$")


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
