"""``attnres_triton``: the Triton kernels as one :class:`~depthmix.kernels._common.KernelOp`.

``depthmix::attnres_fwd`` / ``depthmix::attnres_bwd`` (``torch.library``, with fake
implementations and a registered autograd formula), so a compiled layer calls them without
a graph break; eager calls run the same launchers through a plain ``autograd.Function``
(see :mod:`depthmix.kernels._common`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from depthmix.kernels._common import (
    KernelOp,
    absent,
    acc_dtype,
    add_to_main_grads,
    empty_like_contiguous,
    present,
)
from depthmix.kernels.attnres.triton import attnres_bwd, attnres_fwd, check_sources


def _forward(sources: List[Tensor], query: Tensor, key_weight: Tensor,
             out_weight: Optional[Tensor], eps: float, out_eps: float
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``out [*, d]`` and the per-token statistics ``z``, ``rstd`` ``[S, T]``, ``lse [T]``."""
    return attnres_fwd(sources, query, key_weight, eps, out_weight, out_eps)


def _backward(sources: List[Tensor], query: Tensor, key_weight: Tensor,
              out_weight: Optional[Tensor], out_eps: float, dout: Tensor, z: Tensor,
              rstd: Tensor, lse: Tensor) -> Tuple[List[Tensor], Tensor, Tensor, Tensor]:
    """Gradients of the sources, ``query``, ``key_weight`` and ``out_weight`` (empty
    without an output norm)."""
    dsources, dquery, dkey, dout_weight = attnres_bwd(
        sources, query, key_weight, out_weight, out_eps, dout, z, rstd, lse)
    return dsources, dquery, dkey, present(dout_weight, query)


def _eager_backward(sources, query, key_weight, out_weight, out_eps, dout, z, rstd, lse):
    """:func:`_backward` outside a custom op: the source gradients share one buffer and a
    missing gradient is None."""
    return attnres_bwd(sources, query, key_weight, out_weight, out_eps, dout, z, rstd, lse,
                       grads_as_views=True)


def _setup_context(ctx, inputs, output):
    sources, query, key_weight, out_weight, _eps, out_eps = inputs
    _out, z, rstd, lse = output
    ctx.mark_non_differentiable(z, rstd, lse)
    ctx.set_materialize_grads(False)  # no zeros for the statistics' grads
    ctx.save_for_backward(query, key_weight, out_weight, z, rstd, lse, *sources)
    ctx.out_eps = out_eps
    ctx.params = (query, key_weight, out_weight)  # the parameters themselves (main_grad)


def _gradient(ctx, backward, dout, _dz, _drstd, _dlse):
    if dout is None:  # the output is unused
        return None, None, None, None, None, None
    query, key_weight, out_weight, z, rstd, lse, *sources = ctx.saved_tensors
    dsources, dquery, dkey, dout_weight = backward(
        sources, query, key_weight, out_weight, ctx.out_eps, dout, z, rstd, lse)
    dquery, dkey, dout_weight = add_to_main_grads(ctx.params,
                                                  (dquery, dkey, absent(dout_weight)))
    return dsources, dquery, dkey, dout_weight, None, None


attnres_op = KernelOp("depthmix::attnres", _forward, _backward, setup_context=_setup_context,
                      gradient=_gradient, eager_backward=_eager_backward)


@attnres_op.forward_op.register_fake
def _(sources, query, key_weight, out_weight, eps, out_eps):
    first = sources[0]
    tokens = first.numel() // first.shape[-1]
    z = first.new_empty(len(sources), tokens, dtype=acc_dtype(first.dtype))
    return (empty_like_contiguous(first), z,
            torch.empty_like(z), z.new_empty(tokens))


@attnres_op.backward_op.register_fake
def _(sources, query, key_weight, out_weight, out_eps, dout, z, rstd, lse):
    dsources = [empty_like_contiguous(y) for y in sources]
    return (dsources, torch.empty_like(query), torch.empty_like(key_weight),
            query.new_empty(0) if out_weight is None else torch.empty_like(out_weight))


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
    out, z, _rstd, lse = attnres_op(
        sources, query, key_weight, out_weight, float(eps),
        float(eps if out_eps is None else out_eps))
    if return_weights:
        return out, torch.exp(z - lse).view(len(sources), *sources[0].shape[:-1])
    return out
