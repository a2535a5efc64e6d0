"""Deep Delta Learning's two residual ops in plain PyTorch: the source of truth and the
CPU path (``mixer.impl=torch``; the model's golden losses are this code's).

One sublayer of DDL (Deep Delta Learning, Zhang, Liu, Wang, Gu 2026) on a per-token matrix
state ``X in R^{h x d_v}``::

    x_in = X r                                              ddl_read
    k    = y / sqrt(||y||^2 + K_EPS^2)                      ddl_write, y = F(x_in)
    beta = 2 sigmoid(w_beta . rmsnorm(x_in) + b_beta)
    v    = v_scale sigmoid(W_v x_in + b_v)
    X'   = X + beta k (v^T - k^T X)

The fused kernels (``function.py``) take the same arguments.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

K_EPS = 1e-5
"""``k = y / sqrt(||y||^2 + K_EPS^2)`` (the reference code's ``ddl_k_eps``)."""


def _acc(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()


def ddl_read_reference(x: Tensor, read: Tensor) -> Tensor:
    """``X r``: ``x [..., h, d_v]``, ``read [d_v]`` -> ``[..., h]`` in ``x``'s dtype."""
    return x @ read.to(x.dtype)


def ddl_write_reference(x: Tensor, y: Tensor, x_in: Tensor, beta_weight: Tensor,
                        beta_bias: Tensor, v_weight: Tensor, v_bias: Tensor, v_scale: float,
                        eps: float, return_beta: bool = True):
    """The delta-rule update ``X + beta k (v^T - k^T X)``; returns ``(X', beta)`` (beta None
    without ``return_beta``).

    ``x [..., h, d_v]``, sublayer output ``y [..., h]``, the sublayer's read ``x_in [..., h]``;
    ``beta_weight [h]``, ``beta_bias [1]``, ``v_weight [d_v, h]``, ``v_bias [d_v]``.
    ``k``, ``beta``, ``v``, ``k^T X`` and the row update are fp32; the state stays in its
    dtype (as the reference code does). ``beta [..., 1]`` is fp32 (fp64 for fp64 inputs).
    """
    y32, xin32 = _acc(y), _acc(x_in)
    k = y32 * torch.rsqrt(y32.pow(2).sum(dim=-1, keepdim=True) + K_EPS**2)  # unit direction
    xn = xin32 * torch.rsqrt(xin32.pow(2).mean(dim=-1, keepdim=True) + eps)
    logit = (xn @ beta_weight.to(xn.dtype)).unsqueeze(-1) + beta_bias.to(xn.dtype)
    beta = 2.0 * torch.sigmoid(logit)  # [..., 1]
    v = v_scale * torch.sigmoid(xin32 @ v_weight.to(xin32.dtype).t() + v_bias.to(xin32.dtype))
    kx = k.to(x.dtype).unsqueeze(-1)  # [..., h, 1], one view for both uses
    proj = (kx * x).sum(dim=-2, dtype=k.dtype)  # k^T X  [..., d_v]
    delta = beta * (v - proj)  # [..., d_v]
    return x + kx * delta.to(x.dtype).unsqueeze(-2), (beta if return_beta else None)


class DDLOps(NamedTuple):
    """The two ops of a DDL sublayer, as one implementation."""

    read: Callable
    """``(x, read) -> x_in``"""
    write: Callable
    """``(x, y, x_in, beta_weight, beta_bias, v_weight, v_bias, v_scale, eps, return_beta)
    -> (X', beta or None)``"""


ddl_reference = DDLOps(read=ddl_read_reference, write=ddl_write_reference)
