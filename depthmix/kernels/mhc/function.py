"""The Triton launchers (``triton.py``) as PyTorch custom ops, one forward/backward pair
per op (``depthmix::sinkhorn_*``, ``depthmix::mhc_read_*``, ``depthmix::mhc_post_res_*``),
with fake implementations and registered autograd formulas (see
:mod:`depthmix.kernels._common`), so a compiled layer calls them without a graph break."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from depthmix.kernels._common import absent, acc_dtype, empty_like_contiguous, present
from depthmix.kernels.mhc import triton as kernels
from depthmix.kernels.mhc.reference import MHCOps


def _contiguous(t):
    return None if t is None else t.contiguous()


# ---- Sinkhorn: logits [R, n, n] -> fp32; saves only the logits ----------------------------
@torch.library.custom_op("depthmix::sinkhorn_fwd", mutates_args=())
def _sinkhorn_fwd(logits: Tensor, iters: int) -> Tensor:
    return kernels.sinkhorn_fwd(logits, iters)


@_sinkhorn_fwd.register_fake
def _(logits, iters):
    return logits.new_empty(logits.shape, dtype=acc_dtype(logits.dtype))


@torch.library.custom_op("depthmix::sinkhorn_bwd", mutates_args=())
def _sinkhorn_bwd(logits: Tensor, grad: Tensor, iters: int) -> Tensor:
    return kernels.sinkhorn_bwd(logits, grad.contiguous(), iters)


@_sinkhorn_bwd.register_fake
def _(logits, grad, iters):
    return empty_like_contiguous(logits)


def _sinkhorn_setup(ctx, inputs, output):
    logits, ctx.iters = inputs
    ctx.save_for_backward(logits)


def _sinkhorn_backward(ctx, grad):
    (logits,) = ctx.saved_tensors
    return torch.ops.depthmix.sinkhorn_bwd(logits, grad, ctx.iters), None


_sinkhorn_fwd.register_autograd(_sinkhorn_backward, setup_context=_sinkhorn_setup)


# ---- launch 1: x [T, n, h] -> (x_in, h_pre, h_post, h_res) -------------------------------
# Saves x, the parameters and per token h_pre, the dynamic logits (m values) and rstd: the
# Sinkhorn iterates and the normalised streams are recomputed in the backward.
@torch.library.custom_op("depthmix::mhc_read_fwd", mutates_args=())
def _read_fwd(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, variant: str, iters: int,
              eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(x_in, h_pre, h_post, h_res, dyn, rstd)``; ``h_res`` is empty for ``identity``."""
    x_in, h_pre, h_post, h_res, dyn, rstd = kernels.mhc_read_fwd(
        x, phi, alpha, bias, variant, iters, eps)
    return x_in, h_pre, h_post, present(h_res, h_post), dyn, rstd


@_read_fwd.register_fake
def _(x, phi, alpha, bias, variant, iters, eps):
    tokens, n, h = x.shape
    coef = x.new_empty((tokens, n), dtype=acc_dtype(x.dtype))
    h_res = coef.new_empty((tokens, n, n) if variant != "identity" else (0,))
    return (x.new_empty((tokens, h)), coef, torch.empty_like(coef), h_res,
            coef.new_empty((tokens, phi.shape[1])), coef.new_empty((tokens,)))


@torch.library.custom_op("depthmix::mhc_read_bwd", mutates_args=())
def _read_bwd(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, h_pre: Tensor, dyn: Tensor,
              rstd: Tensor, g_xin: Tensor, g_pre: Optional[Tensor], g_post: Optional[Tensor],
              g_res: Optional[Tensor], variant: str, iters: int
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dphi, dalpha, dbias)``; a None coefficient gradient is skipped."""
    return kernels.mhc_read_bwd(x, phi, alpha, bias, h_pre, dyn, rstd, g_xin.contiguous(),
                                _contiguous(g_pre), _contiguous(g_post), _contiguous(g_res),
                                variant, iters)


@_read_bwd.register_fake
def _(x, phi, alpha, bias, h_pre, dyn, rstd, g_xin, g_pre, g_post, g_res, variant, iters):
    return tuple(empty_like_contiguous(t) for t in (x, phi, alpha, bias))


def _read_setup(ctx, inputs, output):
    x, phi, alpha, bias, ctx.variant, ctx.iters, _eps = inputs
    _x_in, h_pre, _h_post, _h_res, dyn, rstd = output
    ctx.mark_non_differentiable(dyn, rstd)
    ctx.set_materialize_grads(False)  # an unused coefficient's gradient stays None (skipped)
    ctx.save_for_backward(x, phi, alpha, bias, h_pre, dyn, rstd)


def _read_backward(ctx, g_xin, g_pre, g_post, g_res, _g_dyn, _g_rstd):
    x, phi, alpha, bias, h_pre, dyn, rstd = ctx.saved_tensors
    if g_xin is None:
        g_xin = x.new_zeros(x.shape[0], x.shape[2])
    dx, dphi, dalpha, dbias = torch.ops.depthmix.mhc_read_bwd(
        x, phi, alpha, bias, h_pre, dyn, rstd, g_xin, g_pre, g_post, absent(g_res),
        ctx.variant, ctx.iters)
    return dx, dphi, dalpha, dbias, None, None, None


_read_fwd.register_autograd(_read_backward, setup_context=_read_setup)


# ---- launch 2: X' = H_res X + H_post^T y; saves its inputs (no intermediates) -------------
@torch.library.custom_op("depthmix::mhc_post_res_fwd", mutates_args=())
def _post_res_fwd(x: Tensor, y: Tensor, h_post: Tensor, h_res: Optional[Tensor]) -> Tensor:
    return kernels.mhc_post_res_fwd(x, y, h_post, h_res)


@_post_res_fwd.register_fake
def _(x, y, h_post, h_res):
    return empty_like_contiguous(x)


@torch.library.custom_op("depthmix::mhc_post_res_bwd", mutates_args=())
def _post_res_bwd(x: Tensor, y: Tensor, h_post: Tensor, h_res: Optional[Tensor], grad: Tensor
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dy, dh_post, dh_res)``; without ``h_res`` (identity) ``dx`` is ``grad`` itself,
    which an op may not return: both ``dx`` and ``dh_res`` are empty then."""
    dx, dy, dh_post, dh_res = kernels.mhc_post_res_bwd(x, y, h_post, h_res, grad)
    if h_res is None:
        dx = None
    return present(dx, x), dy, dh_post, present(dh_res, h_post)


@_post_res_bwd.register_fake
def _(x, y, h_post, h_res, grad):
    like = empty_like_contiguous
    if h_res is None:
        return x.new_empty(0), like(y), like(h_post), h_post.new_empty(0)
    return like(x), like(y), like(h_post), like(h_res)


def _post_res_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _post_res_backward(ctx, grad):
    x, y, h_post, h_res = ctx.saved_tensors
    grad = grad.contiguous()
    dx, dy, dh_post, dh_res = torch.ops.depthmix.mhc_post_res_bwd(x, y, h_post, h_res, grad)
    return (grad if h_res is None else dx), dy, dh_post, absent(dh_res)


_post_res_fwd.register_autograd(_post_res_backward, setup_context=_post_res_setup)


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
    n = logits.shape[-1]
    out = torch.ops.depthmix.sinkhorn_fwd(logits.reshape(-1, n, n).contiguous(), iters)
    return out.view(logits.shape)


def mhc_read_triton(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
                   variant: str = "mhc", sinkhorn_iters: int = 20, eps: float = 1e-6):
    """Launch 1 of an mHC sublayer (Triton; :func:`depthmix.kernels.mhc.reference.mhc_read`):
    weightless RMSNorm of the flattened streams, the coefficient projection, gates, static
    biases, sigmoid / 2 sigmoid / tanh, Sinkhorn-Knopp, and the sublayer input ``H_pre X``.

    Args: ``x [..., n, h]`` (any float dtype; e.g. the rank's sequence-parallel shard
    ``[s/tp, b, n, h]``), ``phi [n*h, m]``, ``alpha [3]`` (``[2]`` for identity),
    ``bias [m]``; as in :func:`depthmix.kernels.mhc.reference.mhc_coefficients`.

    Returns: ``x_in [..., h]`` in x.dtype, ``h_pre [..., n]``, ``h_post [..., n]``,
    ``h_res [..., n, n]`` (None for ``identity``), the coefficients in fp32 (fp64 for fp64).
    """
    lead, (n, h) = x.shape[:-2], x.shape[-2:]
    x_in, h_pre, h_post, h_res, _dyn, _rstd = torch.ops.depthmix.mhc_read_fwd(
        x.reshape(-1, n, h).contiguous(), phi.contiguous(), alpha.contiguous(),
        bias.contiguous(), variant, sinkhorn_iters, eps)
    h_res = absent(h_res)
    return (x_in.view(*lead, h), h_pre.view(*lead, n), h_post.view(*lead, n),
            None if h_res is None else h_res.view(*lead, n, n))


def mhc_post_res_triton(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor,
                       h_res) -> torch.Tensor:
    """New streams ``H_res X + H_post^T y`` (Triton, launch 2;
    :func:`depthmix.kernels.mhc.reference.mhc_post_res`).

    ``x [..., n, h]``, sublayer output ``y [..., h]``, ``h_post [..., n]``,
    ``h_res [..., n, n]`` or None (identity) -> ``[..., n, h]`` in x.dtype (fp32 arithmetic
    for fp32/bf16, fp64 for fp64 coefficients).
    """
    n, h = x.shape[-2:]
    out = torch.ops.depthmix.mhc_post_res_fwd(
        x.reshape(-1, n, h).contiguous(), y.reshape(-1, h).contiguous(),
        h_post.reshape(-1, n).contiguous(),
        None if h_res is None else h_res.reshape(-1, n, n).contiguous())
    return out.view(x.shape)


mhc_triton = MHCOps(read=mhc_read_triton, post_res=mhc_post_res_triton)
