"""Attention-Residuals aggregation in plain PyTorch: the reference for the fused kernel.

One depth read of AttnRes (the Attention Residuals paper): a learned pseudo-query ``w``
scores each source ``v_s`` through an RMSNorm of the source (the key), a softmax over the sources
gives the weights, and the output is the weighted sum of the raw sources::

    a_s = softmax_s( w . RMSNorm(v_s) )           (fp32, over the S sources)
    out = sum_s a_s v_s                            (optionally followed by an RMSNorm)

It is the contract of the Triton kernel (``attnres_triton``, ``triton.py``): the kernel
takes the same arguments, with the sources passed as a pointer table
rather than stacked, and in backward keeps only per-token statistics (each source's
inverse RMS and the softmax log-normaliser, ``[S, *]`` and ``[*]`` floats) instead of the
stacked fp32 copy this reference materialises.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor


def _rms_normalize(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def attnres_reference(
    sources: Sequence[Tensor],
    query: Tensor,
    key_weight: Tensor,
    eps: float = 1e-6,
    out_weight: Optional[Tensor] = None,
    out_eps: Optional[float] = None,
    return_weights: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Softmax attention over ``S`` depth sources with one static query.

    Args:
        sources: ``S >= 1`` tensors of one shape ``[*, d]`` and dtype (e.g. ``[s, b, d]``
            on the rank's sequence shard); the keys are their RMSNorm, the values the
            sources themselves.
        query: ``[d]`` pseudo-query ``w``.
        key_weight: ``[d]`` gain of the key RMSNorm.
        eps: epsilon of the key RMSNorm.
        out_weight: ``[d]`` gain of an RMSNorm fused onto the output (None: no norm).
        out_eps: its epsilon (defaults to ``eps``).
        return_weights: also return the softmax weights.

    Returns:
        ``out [*, d]`` in the sources' dtype, and with ``return_weights`` the weights
        ``[S, *]`` in the accumulation dtype. Everything is computed in fp32 (fp64 for
        fp64 inputs), whatever the activations' dtype.
    """
    if len(sources) == 0:
        raise ValueError("attnres needs at least one source")
    dtype = sources[0].dtype
    acc = torch.promote_types(dtype, torch.float32)
    # The stack is for the reference only: the kernel reads the sources in place.
    values = torch.stack([v.to(acc) for v in sources])  # [S, *, d]
    keys = _rms_normalize(values, eps) * key_weight.to(acc)  # [S, *, d]
    logits = keys @ query.to(acc)  # [S, *]
    weights = torch.softmax(logits, dim=0)  # [S, *]
    out = (weights.unsqueeze(-1) * values).sum(0)  # [*, d]
    if out_weight is not None:
        out = _rms_normalize(out, eps if out_eps is None else out_eps) * out_weight.to(acc)
    out = out.to(dtype)
    return (out, weights) if return_weights else out
