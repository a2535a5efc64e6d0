"""autograd.Functions over the Triton launchers (``triton.py``), one per op."""

from __future__ import annotations

import torch

from depthmix.kernels.mhc import triton as kernels
from depthmix.kernels.mhc.reference import MHCOps


def _contiguous(t):
    return None if t is None else t.contiguous()


class SinkhornFunction(torch.autograd.Function):
    """``logits [R, n, n]`` -> Sinkhorn-Knopp of ``exp(logits)``; saves only the logits."""

    @staticmethod
    def forward(ctx, logits, iters):
        logits = logits.contiguous()
        ctx.save_for_backward(logits)
        ctx.iters = iters
        return kernels.sinkhorn_fwd(logits, iters)

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        return kernels.sinkhorn_bwd(logits, grad.contiguous(), ctx.iters), None


class MHCReadFunction(torch.autograd.Function):
    """``x [T, n, h]`` -> ``(x_in, h_pre, h_post, h_res)`` (launch 1). Saves ``x``, the
    parameters and per token ``h_pre``, the dynamic logits (``m`` values) and ``rstd``: the
    Sinkhorn iterates and the normalised streams are recomputed in the backward."""

    @staticmethod
    def forward(ctx, x, phi, alpha, bias, variant, iters, eps):
        x, phi, alpha, bias = (t.contiguous() for t in (x, phi, alpha, bias))
        x_in, h_pre, h_post, h_res, dyn, rstd = kernels.mhc_read_fwd(
            x, phi, alpha, bias, variant, iters, eps)
        ctx.save_for_backward(x, phi, alpha, bias, h_pre, dyn, rstd)
        ctx.variant, ctx.iters = variant, iters
        return x_in, h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, g_xin, g_pre, g_post, g_res):
        x, phi, alpha, bias, h_pre, dyn, rstd = ctx.saved_tensors
        if g_xin is None:
            g_xin = torch.zeros(x.shape[0], x.shape[2], dtype=x.dtype, device=x.device)
        dx, dphi, dalpha, dbias = kernels.mhc_read_bwd(
            x, phi, alpha, bias, h_pre, dyn, rstd, g_xin.contiguous(), _contiguous(g_pre),
            _contiguous(g_post), _contiguous(g_res), ctx.variant, ctx.iters)
        return dx, dphi, dalpha, dbias, None, None, None


class MHCPostResFunction(torch.autograd.Function):
    """``X' = H_res X + H_post^T y`` (launch 2); saves its inputs (no intermediates)."""

    @staticmethod
    def forward(ctx, x, y, h_post, h_res):
        x, y, h_post, h_res = (_contiguous(t) for t in (x, y, h_post, h_res))
        ctx.save_for_backward(x, y, h_post, h_res)
        return kernels.mhc_post_res_fwd(x, y, h_post, h_res)

    @staticmethod
    def backward(ctx, grad):
        x, y, h_post, h_res = ctx.saved_tensors
        return kernels.mhc_post_res_bwd(x, y, h_post, h_res, grad.contiguous())


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
    out = SinkhornFunction.apply(logits.reshape(-1, n, n), iters)
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
    x_in, h_pre, h_post, h_res = MHCReadFunction.apply(
        x.reshape(-1, n, h), phi, alpha, bias, variant, sinkhorn_iters, eps)
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
    out = MHCPostResFunction.apply(
        x.reshape(-1, n, h), y.reshape(-1, h), h_post.reshape(-1, n),
        None if h_res is None else h_res.reshape(-1, n, n))
    return out.view(x.shape)


mhc_triton = MHCOps(read=mhc_read_triton, post_res=mhc_post_res_triton)
