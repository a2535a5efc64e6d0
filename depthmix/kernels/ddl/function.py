"""The Triton launchers (``triton.py``) as two :class:`~depthmix.kernels._common.KernelOp`\ s,
``depthmix::ddl_read_*`` and ``depthmix::ddl_write_*``, with fake implementations and
registered autograd formulas, so a compiled layer calls them without a graph break; eager
calls run the same launchers through plain ``autograd.Function``\ s (see
:mod:`depthmix.kernels._common`).

Saved for backward: the inputs (the state and rows exist anyway) and, for the update,
``6 + 3 d_v`` floats per token (statistics, and room for the eager backward's per-token
intermediates); nothing of the state's size is stored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from depthmix.kernels._common import KernelOp, acc_dtype, add_to_main_grads, empty_like_contiguous
from depthmix.kernels.ddl import triton as kernels
from depthmix.kernels.ddl.reference import DDLOps


# ---- read: x [..., h, d_v] -> x_in [..., h] --------------------------------------------
def _read_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.read = inputs[1]  # the parameter itself (its main_grad)


def _read_gradient(ctx, backward, grad):
    x, read = ctx.saved_tensors
    dx, dread = backward(x, read, grad.contiguous())
    return dx, *add_to_main_grads((ctx.read,), (dread,))


read_op = KernelOp("depthmix::ddl_read", kernels.ddl_read_fwd, kernels.ddl_read_bwd,
                   setup_context=_read_setup, gradient=_read_gradient)


@read_op.forward_op.register_fake
def _(x, read):
    return x.new_empty(x.shape[:-1])


@read_op.backward_op.register_fake
def _(x, read, grad):
    return empty_like_contiguous(x), torch.empty_like(read)


# ---- delta update: X' = X + beta k (v^T - k^T X) -------------------------------------------
def _write_setup(ctx, inputs, output):
    x, y, x_in, beta_weight, _beta_bias, v_weight, _v_bias, ctx.v_scale, _eps = inputs
    stats = output[1]
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)  # no zeros for the statistics' gradient
    ctx.save_for_backward(x, y, x_in, beta_weight, v_weight, stats)
    ctx.params = inputs[3:7]  # the parameters themselves (their main_grad)


def _write_gradient(ctx, backward, grad, _dstats):
    if grad is None:  # the new state is unused
        return (None,) * 9
    x, y, x_in, beta_weight, v_weight, stats = ctx.saved_tensors
    dx, dy, dx_in, dparams = backward(x, y, x_in, beta_weight, v_weight, stats, ctx.v_scale,
                                      grad.contiguous())
    dw, db, dwv, dbv = add_to_main_grads(ctx.params,
                                         kernels.split_params(dparams, *x.shape[-2:]))
    return dx, dy, dx_in, dw, db, dwv, dbv, None, None


def _write_eager_backward(x, y, x_in, beta_weight, v_weight, stats, v_scale, grad):
    """The backward outside a custom op: its per-token intermediates in the room ``stats``
    keeps for them, not a buffer of their own."""
    return kernels.ddl_write_bwd(x, y, x_in, beta_weight, v_weight, stats, v_scale, grad,
                                 in_stats=True)


write_op = KernelOp("depthmix::ddl_write", kernels.ddl_write_fwd, kernels.ddl_write_bwd,
                    setup_context=_write_setup, gradient=_write_gradient,
                    eager_backward=_write_eager_backward)


@write_op.forward_op.register_fake
def _(x, y, x_in, beta_weight, beta_bias, v_weight, v_bias, v_scale, eps):
    stats = x.new_empty((*x.shape[:-2], kernels.stats_width(x.shape[-1])),
                        dtype=acc_dtype(x.dtype))
    return empty_like_contiguous(x), stats


@write_op.backward_op.register_fake
def _(x, y, x_in, beta_weight, v_weight, stats, v_scale, grad):
    h, dv = x.shape[-2:]
    return (empty_like_contiguous(x), empty_like_contiguous(y), empty_like_contiguous(x_in),
            beta_weight.new_empty(h * (dv + 1) + 1 + dv))


# ---------------------------------------------------------------------------------------
# Public functions: the signatures and docstrings of reference.py
# ---------------------------------------------------------------------------------------


def ddl_read_triton(x: Tensor, read: Tensor) -> Tensor:
    """``X r`` (Triton; :func:`depthmix.kernels.ddl.reference.ddl_read_reference`):
    ``x [..., h, d_v]``, ``read [d_v]`` -> ``[..., h]`` in ``x``'s dtype (fp32 sums)."""
    return read_op(x.contiguous(), read.contiguous())


def ddl_write_triton(x: Tensor, y: Tensor, x_in: Tensor, beta_weight: Tensor,
                     beta_bias: Tensor, v_weight: Tensor, v_bias: Tensor, v_scale: float,
                     eps: float, return_beta: bool = True):
    """The delta-rule update ``X + beta k (v^T - k^T X)`` (Triton, one launch forward, two
    backward; :func:`depthmix.kernels.ddl.reference.ddl_write_reference`); returns
    ``(X', beta)`` (beta None without ``return_beta``).

    ``x [..., h, d_v]``, sublayer output ``y [..., h]``, the sublayer's read ``x_in [..., h]``;
    ``beta_weight [h]``, ``beta_bias [1]``, ``v_weight [d_v, h]``, ``v_bias [d_v]`` of one
    dtype. Everything is fp32 (fp64 for fp64 inputs) up to the store of ``X'`` in ``x``'s
    dtype; ``beta [..., 1]`` is fp32 and carries no gradient (a view of the statistics the
    backward keeps).
    """
    kernels.check_write(x, beta_weight, beta_bias, v_weight, v_bias)
    out, stats = write_op(x.contiguous(), y.contiguous(), x_in.contiguous(),
                          beta_weight.contiguous(), beta_bias.contiguous(),
                          v_weight.contiguous(), v_bias.contiguous(), float(v_scale),
                          float(eps))
    return out, (stats[..., 2:3] if return_beta else None)


ddl_triton = DDLOps(read=ddl_read_triton, write=ddl_write_triton)
