"""The Triton launchers (``triton.py``) as :class:`~depthmix.kernels._common.KernelOp`\ s,
one forward/backward pair of custom ops each (``depthmix::sinkhorn_*``,
``depthmix::mhc_read_*``, ``depthmix::mhc_post_res_*``) with fake implementations and
registered autograd formulas, so a compiled layer calls them without a graph break; eager
calls run the same launchers through plain ``autograd.Function``\ s (see
:mod:`depthmix.kernels._common`)."""

from __future__ import annotations

from typing import Optional, Tuple

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
from depthmix.kernels.mhc import triton as kernels
from depthmix.kernels.mhc.reference import MHCOps


def _contiguous(t):
    return None if t is None else t.contiguous()


# ---- Sinkhorn: logits [..., n, n] -> fp32; saves only the logits ----------------------------
def _sinkhorn_forward(logits: Tensor, iters: int) -> Tensor:
    return kernels.sinkhorn_fwd(logits, iters)


def _sinkhorn_backward(logits: Tensor, grad: Tensor, iters: int) -> Tensor:
    return kernels.sinkhorn_bwd(logits, grad.contiguous(), iters)


def _sinkhorn_setup(ctx, inputs, output):
    logits, ctx.iters = inputs
    ctx.save_for_backward(logits)


def _sinkhorn_gradient(ctx, backward, grad):
    (logits,) = ctx.saved_tensors
    return backward(logits, grad, ctx.iters), None


sinkhorn_op = KernelOp("depthmix::sinkhorn", _sinkhorn_forward, _sinkhorn_backward,
                       setup_context=_sinkhorn_setup, gradient=_sinkhorn_gradient)


@sinkhorn_op.forward_op.register_fake
def _(logits, iters):
    return logits.new_empty(logits.shape, dtype=acc_dtype(logits.dtype))


@sinkhorn_op.backward_op.register_fake
def _(logits, grad, iters):
    return empty_like_contiguous(logits)


# ---- launch 1: x [..., n, h] -> (x_in, h_pre, h_post, h_res) -----------------------------
# Saves x, the parameters and per token h_pre, the dynamic logits (m values) and rstd: the
# Sinkhorn iterates and the normalised streams are recomputed in the backward. With a
# norm_weight, x_in is the sublayer's RMSNorm of H_pre X (recomputed in the backward too).
def _read_forward(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, variant: str,
                  iters: int, eps: float, norm_weight: Optional[Tensor] = None,
                  norm_eps: float = 0.0
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(x_in, h_pre, h_post, h_res, dyn, rstd)``; ``h_res`` is empty for ``identity``."""
    x_in, h_pre, h_post, h_res, dyn, rstd = kernels.mhc_read_fwd(
        x, phi, alpha, bias, variant, iters, eps, norm_weight, norm_eps)
    return x_in, h_pre, h_post, present(h_res, h_post), dyn, rstd


def _read_backward(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, h_pre: Tensor,
                   dyn: Tensor, rstd: Tensor, g_xin: Tensor, g_pre: Optional[Tensor],
                   g_post: Optional[Tensor], g_res: Optional[Tensor], variant: str, iters: int,
                   norm_weight: Optional[Tensor], norm_eps: float
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dphi, dalpha, dbias, dnorm_weight)``; a None coefficient gradient is skipped,
    ``dnorm_weight`` is empty without a norm."""
    *grads, dnorm = kernels.mhc_read_bwd(
        x, phi, alpha, bias, h_pre, dyn, rstd, g_xin.contiguous(), _contiguous(g_pre),
        _contiguous(g_post), _contiguous(g_res), variant, iters, norm_weight, norm_eps)
    return (*grads, present(dnorm, bias))


def _read_setup(ctx, inputs, output):
    x, phi, alpha, bias, ctx.variant, ctx.iters, _eps, norm_weight, ctx.norm_eps = inputs
    _x_in, h_pre, _h_post, _h_res, dyn, rstd = output
    ctx.mark_non_differentiable(dyn, rstd)
    ctx.set_materialize_grads(False)  # an unused coefficient's gradient stays None (skipped)
    ctx.save_for_backward(x, phi, alpha, bias, h_pre, dyn, rstd, norm_weight)
    ctx.params = (phi, alpha, bias, norm_weight)  # the parameters themselves (main_grad)


def _read_gradient(ctx, backward, g_xin, g_pre, g_post, g_res, _g_dyn, _g_rstd):
    x, phi, alpha, bias, h_pre, dyn, rstd, norm_weight = ctx.saved_tensors
    if g_xin is None:
        g_xin = x.new_zeros(x.shape[:-2] + x.shape[-1:])  # [..., h]
    dx, dphi, dalpha, dbias, dnorm = backward(
        x, phi, alpha, bias, h_pre, dyn, rstd, g_xin, g_pre, g_post, absent(g_res),
        ctx.variant, ctx.iters, norm_weight, ctx.norm_eps)
    dphi, dalpha, dbias, dnorm = add_to_main_grads(ctx.params,
                                                   (dphi, dalpha, dbias, absent(dnorm)))
    return dx, dphi, dalpha, dbias, None, None, None, dnorm, None


def _read_eager_backward(x, phi, alpha, bias, h_pre, dyn, rstd, g_xin, g_pre, g_post, g_res,
                         variant, iters, norm_weight, norm_eps):
    """:func:`_read_backward` outside a custom op: ``dalpha``, ``dbias`` views of one sum."""
    return kernels.mhc_read_bwd(x, phi, alpha, bias, h_pre, dyn, rstd, g_xin.contiguous(),
                                _contiguous(g_pre), _contiguous(g_post), _contiguous(g_res),
                                variant, iters, norm_weight, norm_eps, grads_as_views=True)


read_op = KernelOp("depthmix::mhc_read", _read_forward, _read_backward,
                   setup_context=_read_setup, gradient=_read_gradient,
                   eager_forward=kernels.mhc_read_fwd, eager_backward=_read_eager_backward)


@read_op.forward_op.register_fake
def _(x, phi, alpha, bias, variant, iters, eps, norm_weight=None, norm_eps=0.0):
    *lead, n, h = x.shape
    coef = x.new_empty((*lead, n), dtype=acc_dtype(x.dtype))
    h_res = coef.new_empty((*lead, n, n) if variant != "identity" else (0,))
    return (x.new_empty((*lead, h)), coef, torch.empty_like(coef), h_res,
            coef.new_empty((*lead, phi.shape[1])), coef.new_empty(lead))


@read_op.backward_op.register_fake
def _(x, phi, alpha, bias, h_pre, dyn, rstd, g_xin, g_pre, g_post, g_res, variant, iters,
      norm_weight, norm_eps):
    grads = tuple(empty_like_contiguous(t) for t in (x, phi, alpha, bias))
    return (*grads, bias.new_empty(0) if norm_weight is None else torch.empty_like(norm_weight))


# ---- launch 2: X' = H_res X + H_post^T y; saves its inputs (no intermediates) -------------
def _post_res_forward(x: Tensor, y: Tensor, h_post: Tensor, h_res: Optional[Tensor]) -> Tensor:
    return kernels.mhc_post_res_fwd(x, y, h_post, h_res)


def _post_res_backward(x: Tensor, y: Tensor, h_post: Tensor, h_res: Optional[Tensor],
                       grad: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dy, dh_post, dh_res)``; without ``h_res`` (identity) ``dx`` is ``grad`` itself,
    which an op may not return: both ``dx`` and ``dh_res`` are empty then."""
    dx, dy, dh_post, dh_res = kernels.mhc_post_res_bwd(x, y, h_post, h_res, grad)
    if h_res is None:
        dx = None
    return present(dx, x), dy, dh_post, present(dh_res, h_post)


def _post_res_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _post_res_gradient(ctx, backward, grad):
    x, y, h_post, h_res = ctx.saved_tensors
    grad = grad.contiguous()
    dx, dy, dh_post, dh_res = backward(x, y, h_post, h_res, grad)
    return (grad if h_res is None else dx), dy, dh_post, absent(dh_res)


post_res_op = KernelOp("depthmix::mhc_post_res", _post_res_forward, _post_res_backward,
                       setup_context=_post_res_setup, gradient=_post_res_gradient,
                       eager_backward=kernels.mhc_post_res_bwd)


@post_res_op.forward_op.register_fake
def _(x, y, h_post, h_res):
    return empty_like_contiguous(x)


@post_res_op.backward_op.register_fake
def _(x, y, h_post, h_res, grad):
    like = empty_like_contiguous
    if h_res is None:
        return x.new_empty(0), like(y), like(h_post), h_post.new_empty(0)
    return like(x), like(y), like(h_post), like(h_res)


# ---------------------------------------------------------------------------------------
# Public functions: the signatures and docstrings of reference.py
# ---------------------------------------------------------------------------------------


def sinkhorn_triton(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``exp(logits)`` towards the doubly stochastic matrices
    (Triton; :func:`depthmix.kernels.mhc.reference.sinkhorn`).

    ``logits [..., n, n]`` -> ``[..., n, n]`` in fp32 (fp64 for fp64 input); row max
    subtracted before ``exp``; ``iters`` row-then-column normalisations. The backward is
    the exact gradient of this fixed-iteration map, recomputing the iterates (nothing but
    the logits is saved).
    """
    return sinkhorn_op(logits.contiguous(), iters)


def mhc_read_triton(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
                   variant: str = "mhc", sinkhorn_iters: int = 20, eps: float = 1e-6,
                   norm_weight: Optional[torch.Tensor] = None, norm_eps: Optional[float] = None):
    """Launch 1 of an mHC sublayer (Triton; :func:`depthmix.kernels.mhc.reference.mhc_read`):
    weightless RMSNorm of the flattened streams, the coefficient projection, gates, static
    biases, sigmoid / 2 sigmoid / tanh, Sinkhorn-Knopp, and the sublayer input ``H_pre X``.

    Args: ``x [..., n, h]`` (any float dtype; e.g. the rank's sequence-parallel shard
    ``[s/tp, b, n, h]``), ``phi [n*h, m]``, ``alpha [3]`` (``[2]`` for identity),
    ``bias [m]``; as in :func:`depthmix.kernels.mhc.reference.mhc_coefficients`;
    ``norm_weight [h]``: the sublayer's input RMSNorm applied to ``H_pre X`` in the same
    launch (None: no norm), ``norm_eps`` its epsilon (defaults to ``eps``).

    Returns: ``x_in [..., h]`` in x.dtype (normed with a ``norm_weight``), ``h_pre [..., n]``,
    ``h_post [..., n]``, ``h_res [..., n, n]`` (None for ``identity``), the coefficients in
    fp32 (fp64 for fp64).
    """
    x_in, h_pre, h_post, h_res, _dyn, _rstd = read_op(
        x.contiguous(), phi.contiguous(), alpha.contiguous(), bias.contiguous(), variant,
        sinkhorn_iters, eps, norm_weight, float(eps if norm_eps is None else norm_eps))
    return x_in, h_pre, h_post, absent(h_res)


def mhc_post_res_triton(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor,
                       h_res) -> torch.Tensor:
    """New streams ``H_res X + H_post^T y`` (Triton, launch 2;
    :func:`depthmix.kernels.mhc.reference.mhc_post_res`).

    ``x [..., n, h]``, sublayer output ``y [..., h]``, ``h_post [..., n]``,
    ``h_res [..., n, n]`` or None (identity) -> ``[..., n, h]`` in x.dtype (fp32 arithmetic
    for fp32/bf16, fp64 for fp64 coefficients).
    """
    return post_res_op(x.contiguous(), y.contiguous(), h_post.contiguous(),
                       None if h_res is None else h_res.contiguous())


mhc_triton = MHCOps(read=mhc_read_triton, post_res=mhc_post_res_triton)
