"""mHC / Hyper-Connections stream mixing: the plain PyTorch reference.

It is the contract of the fused kernels (``function.py``: RMSNorm of the flattened
streams, coefficient projection, Sinkhorn-Knopp and the stream mix in two launches). Everything is
computed in fp32 (fp64 inputs stay fp64, for tests); callers cast results back to the
activation dtype.

Notation (one token; leading dimensions ``...`` are the tokens, e.g. ``[s, b]``): ``n``
residual streams of width ``h``, state ``X [n, h]``. One sublayer ``F``::

    x_in = H_pre X                     (mhc_pre)
    X'   = H_res X + H_post^T F(x_in)  (mhc_post_res_reference)

with per-token coefficients from :func:`mhc_coefficients`. The coefficient network of
one sublayer has a projection ``phi [n*h, m]``, gates ``alpha`` and static biases
``bias [m]``; the ``m`` columns are ``pre (n) | post (n) | res (n*n, row-major: entry
(i, j) is the weight of source stream j in output stream i)``; the ``identity`` variant
has no ``res`` part (``m = 2n``, ``H_res = I``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from depthmix.kernels.modes import MHC_VARIANTS as VARIANTS


def _acc(t: Tensor) -> Tensor:
    """At least fp32 (fp64 stays fp64)."""
    return t if t.dtype == torch.float64 else t.float()


def sinkhorn_reference(logits: Tensor, iters: int) -> Tensor:
    """Sinkhorn-Knopp projection of ``exp(logits)`` towards the doubly stochastic matrices.

    ``logits [..., n, n]`` -> ``[..., n, n]`` in fp32 (fp64 for fp64 input). The row max is
    subtracted before ``exp`` (exact: the first row normalisation undoes any per-row
    scale). Each of the ``iters`` iterations normalises the rows, then the columns, so
    columns sum to 1 exactly and rows to within the (geometric) convergence error.
    The backward is autograd through the ``iters`` unrolled iterations, i.e. the exact
    gradient of this fixed-iteration map.
    """
    m = _acc(logits)
    m = torch.exp(m - m.amax(dim=-1, keepdim=True))
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True)
        m = m / m.sum(dim=-2, keepdim=True)
    return m


def mhc_coefficients(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor,
                     variant: str = "mhc", sinkhorn_iters: int = 20, eps: float = 1e-6
                     ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Per-token stream coefficients of one sublayer.

    Args:
        x: streams ``[..., n, h]``.
        phi: ``[n*h, m]`` dynamic projection (``m = 2n + n^2``, ``2n`` for ``identity``).
        alpha: gates ``[3]`` (pre, post, res) or ``[2]`` for ``identity``.
        bias: static biases ``[m]``.
        variant: ``mhc`` (Xie et al. 2025):
            ``H_pre = sigmoid(a_pre d_pre + b_pre)``,
            ``H_post = 2 sigmoid(a_post d_post + b_post)``,
            ``H_res = sinkhorn_reference(a_res d_res + b_res)``;
            ``hc`` (Zhu et al. 2025, unconstrained): ``H = b + a tanh(d)`` for all three;
            ``identity``: ``hc`` for pre/post and ``H_res = I``.
            Here ``d = RMSNorm(flatten(x)) @ phi`` (weightless RMSNorm over ``n*h``).
        sinkhorn_iters: Sinkhorn-Knopp iterations (``mhc`` only).
        eps: RMSNorm epsilon.

    Returns:
        ``h_pre [..., n]``, ``h_post [..., n]``, ``h_res [..., n, n]`` (None for ``identity``),
        all fp32 (fp64 for fp64 input).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {VARIANTS}")
    n = x.shape[-2]
    flat = _acc(x.flatten(-2))  # [..., n*h]
    normed = flat * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + eps)
    dyn = normed @ phi.to(normed.dtype)  # [..., m]
    a, b = alpha.to(dyn.dtype), bias.to(dyn.dtype)
    d_pre, d_post, d_res = dyn[..., :n], dyn[..., n:2 * n], dyn[..., 2 * n:]
    b_pre, b_post, b_res = b[:n], b[n:2 * n], b[2 * n:]
    if variant == "mhc":
        h_pre = torch.sigmoid(a[0] * d_pre + b_pre)
        h_post = 2.0 * torch.sigmoid(a[1] * d_post + b_post)
        h_res = sinkhorn_reference((a[2] * d_res + b_res).reshape(*d_res.shape[:-1], n, n),
                                   sinkhorn_iters)
        return h_pre, h_post, h_res
    h_pre = b_pre + a[0] * torch.tanh(d_pre)
    h_post = b_post + a[1] * torch.tanh(d_post)
    if variant == "identity":
        return h_pre, h_post, None
    h_res = (b_res + a[2] * torch.tanh(d_res)).reshape(*d_res.shape[:-1], n, n)
    return h_pre, h_post, h_res


def mhc_pre(x: Tensor, h_pre: Tensor) -> Tensor:
    """Sublayer input ``sum_i H_pre[i] X[i]``: ``x [..., n, h]``, ``h_pre [..., n]`` -> ``[..., h]``
    (fp32; fp64 for fp64 input)."""
    return (h_pre.unsqueeze(-2) @ _acc(x)).squeeze(-2)


def mhc_read_reference(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, variant: str = "mhc",
             sinkhorn_iters: int = 20, eps: float = 1e-6, norm_weight: Optional[Tensor] = None,
             norm_eps: Optional[float] = None
             ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """What a sublayer reads (the first launch of the fused kernel): the coefficients of
    :func:`mhc_coefficients` and the sublayer input :func:`mhc_pre` cast to ``x.dtype``;
    with ``norm_weight [h]`` the input goes through the sublayer's RMSNorm first
    (``x_in rsqrt(mean(x_in^2) + norm_eps) norm_weight`` in fp32; ``norm_eps`` defaults to
    ``eps``).

    Returns ``x_in [..., h]`` (x.dtype), ``h_pre [..., n]``, ``h_post [..., n]``,
    ``h_res [..., n, n]`` or None.
    """
    h_pre, h_post, h_res = mhc_coefficients(x, phi, alpha, bias, variant, sinkhorn_iters, eps)
    x_in = mhc_pre(x, h_pre)
    if norm_weight is not None:
        norm_eps = eps if norm_eps is None else norm_eps
        x_in = x_in * torch.rsqrt(x_in.pow(2).mean(-1, keepdim=True) + norm_eps)
        x_in = x_in * norm_weight.to(x_in.dtype)
    return x_in.to(x.dtype), h_pre, h_post, h_res


def mhc_post_res_reference(x: Tensor, y: Tensor, h_post: Tensor, h_res: Optional[Tensor]) -> Tensor:
    """New streams ``H_res X + H_post^T y``.

    ``x [..., n, h]``, sublayer output ``y [..., h]``, ``h_post [..., n]``,
    ``h_res [..., n, n]`` or None (identity) -> ``[..., n, h]`` (fp32; fp64 for fp64 input).
    """
    x = _acc(x)
    mixed = x if h_res is None else h_res @ x
    return mixed + h_post.unsqueeze(-1) * _acc(y).unsqueeze(-2)


class MHCOps(NamedTuple):
    """The two launches of one mHC sublayer, as one implementation."""

    read: Callable
    """``(x, phi, alpha, bias, variant, sinkhorn_iters, eps[, norm_weight, norm_eps]) ->
    (x_in, h_pre, h_post, h_res)``"""
    post_res: Callable
    """``(x, y, h_post, h_res) -> new streams``"""


mhc_reference = MHCOps(read=mhc_read_reference, post_res=mhc_post_res_reference)
