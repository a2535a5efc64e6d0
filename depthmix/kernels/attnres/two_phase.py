"""Two-phase Block AttnRes aggregation for inference (Attention Residuals, two-phase inference).

The pseudo-queries are parameters, not functions of the token, so when block ``k`` opens
every query its ``m`` sublayers will use is already known, and so are the completed blocks
``b_0 .. b_{k-1}`` they all read. The Kimi paper splits the reads in two:

* **phase 1** (once per block): the scores of all ``m`` queries against the ``k`` completed
  blocks in one batched matmul, reduced to online-softmax partials per sublayer ``i``::

      z_ij = (w_i * g_i) . RMSNorm(b_j)       (g_i: sublayer i's key-norm gain)
      M_i  = max_j z_ij,   L_i = sum_j e^{z_ij - M_i},   O_i = sum_j e^{z_ij - M_i} b_j

  Each completed block is read once for the whole block instead of once per sublayer.
* **phase 2** (per sublayer, sequentially): the score ``z_p`` of sublayer ``i`` against its
  block's running partial sum ``p`` (absent at the block's first sublayer), merged by the
  online-softmax rule::

      M = max(M_i, z_p),  L = L_i e^{M_i - M} + e^{z_p - M},  O = O_i e^{M_i - M} + e^{z_p - M} p
      h_i = O / L

This equals :func:`~depthmix.kernels.attnres.reference.attnres_reference` over
``[b_0, .., b_{k-1}, p]`` up to rounding (``(w*g).RMSNorm(b)`` is ``w.(g*RMSNorm(b))``).
Statistics and accumulators are fp32 (fp64 for fp64 inputs); outputs take the sources' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor


def _rms_normalize(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@dataclass
class BlockPartials:
    """Phase 1's online-softmax partials of the ``m`` sublayers of one block."""

    max: Tensor
    """``[m, *]`` largest score over the completed blocks."""
    sum: Tensor
    """``[m, *]`` sum of ``exp(score - max)``."""
    weighted: Tensor
    """``[m, *, d]`` sum of ``exp(score - max) * b_j`` (fp32/fp64)."""


def inter_block_partials(blocks: Sequence[Tensor], queries: Tensor, key_weights: Tensor,
                         eps: float) -> BlockPartials:
    """Phase 1: ``blocks`` ``S >= 1`` completed block sums ``[*, d]``; ``queries`` and
    ``key_weights`` ``[m, d]``, one row per sublayer of the block (pseudo-query, key-norm
    gain). The scores of all ``m`` rows are one batched matmul over the ``S`` blocks."""
    acc = torch.promote_types(blocks[0].dtype, torch.float32)
    values = torch.stack([b.to(acc) for b in blocks])  # [S, *, d]
    keys = _rms_normalize(values, eps)  # [S, *, d]
    q = queries.to(acc) * key_weights.to(acc)  # [m, d]
    scores = torch.einsum("s...d,md->ms...", keys, q)  # [m, S, *]
    top = scores.amax(dim=1)  # [m, *]
    e = torch.exp(scores - top.unsqueeze(1))  # [m, S, *]
    weighted = torch.einsum("ms...,s...d->m...d", e, values)  # [m, *, d]
    return BlockPartials(top, e.sum(dim=1), weighted)


def merge_partial(partials: BlockPartials, row: int, partial: Optional[Tensor], query: Tensor,
                  key_weight: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """Phase 2 for the sublayer in ``row`` of the block: merge its inter-block partials with
    its score against the block's running ``partial`` sum ``[*, d]`` (None at the block's
    first sublayer). Returns ``h [*, d]`` in ``dtype``."""
    top, total, out = partials.max[row], partials.sum[row], partials.weighted[row]
    if partial is not None:
        p = partial.to(out.dtype)
        z = _rms_normalize(p, eps) @ (query.to(out.dtype) * key_weight.to(out.dtype))  # [*]
        new_top = torch.maximum(top, z)
        old, own = torch.exp(top - new_top), torch.exp(z - new_top)
        total = total * old + own
        out = out * old.unsqueeze(-1) + own.unsqueeze(-1) * p
    return (out / total.unsqueeze(-1)).to(dtype)
