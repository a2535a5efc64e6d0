"""``attnres_triton``: the Triton kernels behind one ``torch.autograd.Function``."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from depthmix.kernels.attnres.triton import attnres_bwd, attnres_fwd, check_sources


class AttnResFunction(torch.autograd.Function):
    """Inputs ``(query, key_weight, out_weight, eps, out_eps, return_weights, *sources)``;
    outputs ``(out, weights)`` with ``weights`` empty unless requested, never
    differentiable. Saved for backward: the sources and parameters (references to live
    tensors) and the per-token statistics ``z``, ``rstd`` ``[S, T]`` and ``lse`` ``[T]``."""

    @staticmethod
    def forward(ctx, query, key_weight, out_weight, eps, out_eps, return_weights, *sources):
        out, z, rstd, lse = attnres_fwd(sources, query, key_weight, eps, out_weight, out_eps)
        weights = torch.exp(z - lse) if return_weights else z.new_empty(0)
        ctx.mark_non_differentiable(weights)
        ctx.save_for_backward(query, key_weight, out_weight, z, rstd, lse, *sources)
        ctx.out_eps = out_eps
        return out, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dweights):
        query, key_weight, out_weight, z, rstd, lse, *sources = ctx.saved_tensors
        dsources, dquery, dkey, dout_weight = attnres_bwd(
            sources, query, key_weight, out_weight, ctx.out_eps, dout, z, rstd, lse)
        return (dquery, dkey, dout_weight, None, None, None, *dsources)


def attnres_triton(
    sources: Sequence[Tensor],
    query: Tensor,
    key_weight: Tensor,
    eps: float = 1e-6,
    out_weight: Optional[Tensor] = None,
    out_eps: Optional[float] = None,
    return_weights: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Softmax attention over ``S`` depth sources with one static query (fused kernel).

    Same contract as :func:`depthmix.kernels.attnres.attnres_reference`::

        a_s = softmax_s( w . RMSNorm(v_s) )           (fp32, over the S sources)
        out = sum_s a_s v_s                            (optionally followed by an RMSNorm)

    The sources are read in place through a pointer table (never stacked); backward keeps
    only per-token statistics and recomputes the rest.

    Args:
        sources: ``S >= 1`` tensors of one shape ``[*, d]``, dtype and device (e.g.
            ``[s, b, d]`` on the rank's sequence shard; any ``d <= 16384``).
        query: ``[d]`` pseudo-query ``w``.
        key_weight: ``[d]`` gain of the key RMSNorm.
        eps: epsilon of the key RMSNorm.
        out_weight: ``[d]`` gain of an RMSNorm fused onto the output (None: no norm).
        out_eps: its epsilon (defaults to ``eps``).
        return_weights: also return the softmax weights (without gradient).

    Returns:
        ``out [*, d]`` in the sources' dtype, and with ``return_weights`` the weights
        ``[S, *]`` in the accumulation dtype. Statistics are fp32 (fp64 for fp64 inputs).
    """
    sources = check_sources(sources)
    out, weights = AttnResFunction.apply(
        query, key_weight, out_weight, float(eps), float(eps if out_eps is None else out_eps),
        return_weights, *sources)
    if return_weights:
        return out, weights.view(len(sources), *sources[0].shape[:-1])
    return out
