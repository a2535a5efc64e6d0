"""Fused Triton kernels of DDL's read and delta update, then their host launchers.

Tensors are read in place: the state ``X [T, h, d_v]`` (``T`` the tokens of the leading
dims), rows ``[T, h]``. Tiles are ``[BT tokens, BH hidden, BDV value channels]`` (``BDV``
the next power of two of ``d_v``, masked); the update's kernels loop over ``h`` in chunks
of ``BH``, so any width runs. Statistics and arithmetic are fp32 (fp64 for fp64 inputs).

Read, ``x_in = X r`` (``ddl_read_fwd_kernel``); backward ``dX = g r^T`` and per program
a partial of ``dr = sum_{t,h} g X`` that the host sums (``ddl_read_bwd_kernel``).

Delta update (``ddl_write_fwd_kernel``), per token, two passes over ``h``: the first
accumulates ``||y||^2``, ``||x_in||^2``, ``w_beta . x_in``, ``W_v x_in`` and ``y^T X``,
which give::

    r_k = (||y||^2 + K_EPS^2)^-1/2,  k = r_k y,   r_x = (mean(x_in^2) + eps)^-1/2
    beta = 2 sigmoid(r_x w_beta . x_in + b_beta),  v = v_scale sigmoid(W_v x_in + b_v)
    p = k^T X = r_k y^T X,   delta = beta (v - p)

and the second writes ``X' = X + k delta^T`` (``X`` again, from L2). Per token it keeps
``r_k, r_x, beta, w_beta . xn, v, p`` (``4 + 2 d_v`` floats) for the backward, and room
for the backward's ``2 + d_v`` per-token intermediates.

Backward (``ddl_write_bwd_kernel``), ``G = dL/dX'``: pass A forms ``dδ = k^T G``, then per
token ``dp = -beta dδ``, ``dv = beta dδ``, ``dbeta = dδ . (v - p)``,
``dl = dbeta beta (1 - beta / 2)``, ``du = dv v (1 - v / v_scale)`` and
``k . dk = dδ . delta + p . dp``; pass B writes::

    dX    = G + k dp^T
    dy    = r_k (dk - k (k . dk)),         dk = G delta + X dp
    dx_in = W_v^T du + r_x dl (w_beta - xn (w_beta . xn) / h)

and per token ``dl``, ``dl r_x`` and ``du``, from which ``ddl_write_params_kernel``
(one program per ``BH`` hidden columns, every token; no partials, no atomics) reduces the
parameters' gradients ``dw_beta = sum dl xn``, ``dW_v = sum du x_in^T``, ``db_beta``,
``db_v`` straight into one buffer in the parameters' dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from depthmix.kernels._common import (
    acc_dtype,
    cdiv,
    host_cache,
    interpreting,
    next_power_of_2,
    tl_dtype,
)

K_EPS = 1e-5
"""As :data:`depthmix.kernels.ddl.reference.K_EPS`."""


def saved_width(dv: int) -> int:
    """Floats per token the update keeps for its backward: ``r_k, r_x, beta, w.xn, v, p``."""
    return 4 + 2 * dv


def stats_width(dv: int) -> int:
    """Columns of the update's statistics: :func:`saved_width`, then room for the
    backward's per-token ``dl, dl r_x, du`` (``2 + d_v``; written by an eager backward
    there instead of into a buffer of its own, one allocation fewer)."""
    return saved_width(dv) + 2 + dv


@triton.jit
def _tile3(t, h, d, H, DV: tl.constexpr):
    """Offsets ``[BT, BH, BDV]`` into a contiguous ``[T, H, DV]`` tensor."""
    return t[:, None, None] * (H * DV) + h[None, :, None] * DV + d[None, None, :]


@triton.jit
def ddl_read_fwd_kernel(x, r, out, T, H, DV: tl.constexpr, BT: tl.constexpr,
                        BH: tl.constexpr, BDV: tl.constexpr, ACC: tl.constexpr):
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_h = i_h * BH + tl.arange(0, BH)
    o_d = tl.arange(0, BDV)
    m_th = (o_t < T)[:, None] & (o_h < H)[None, :]
    m_d = o_d < DV
    # r in the state's dtype first, as the reference's ``x @ r.to(x.dtype)``
    b_r = tl.load(r + o_d, mask=m_d, other=0.).to(x.dtype.element_ty).to(ACC)
    b_x = tl.load(x + _tile3(o_t, o_h, o_d, H, DV), mask=m_th[:, :, None] & m_d[None, None, :],
                  other=0.).to(ACC)
    b_o = tl.sum(b_x * b_r[None, None, :], axis=2)
    tl.store(out + o_t[:, None] * H + o_h[None, :], b_o.to(out.dtype.element_ty), mask=m_th)


@triton.jit
def ddl_read_bwd_kernel(x, r, g, dx, dr, T, H, DV: tl.constexpr, BT: tl.constexpr,
                        BH: tl.constexpr, BDV: tl.constexpr, ACC: tl.constexpr):
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_h = i_h * BH + tl.arange(0, BH)
    o_d = tl.arange(0, BDV)
    m_th = (o_t < T)[:, None] & (o_h < H)[None, :]
    m_d = o_d < DV
    m = m_th[:, :, None] & m_d[None, None, :]
    o_x = _tile3(o_t, o_h, o_d, H, DV)
    b_r = tl.load(r + o_d, mask=m_d, other=0.).to(x.dtype.element_ty).to(ACC)
    b_g = tl.load(g + o_t[:, None] * H + o_h[None, :], mask=m_th, other=0.).to(ACC)
    tl.store(dx + o_x, (b_g[:, :, None] * b_r[None, None, :]).to(dx.dtype.element_ty), mask=m)
    b_x = tl.load(x + o_x, mask=m, other=0.).to(ACC)
    b_dr = tl.sum(tl.sum(b_x * b_g[:, :, None], axis=1), axis=0)
    i_p = i_t * tl.num_programs(1) + i_h
    tl.store(dr + i_p * DV + o_d, b_dr, mask=m_d)


@triton.jit
def ddl_write_fwd_kernel(
    x, y, xin,  # [T, H, DV], [T, H], [T, H]
    wb, bb, wv, bv,  # beta_weight [H], beta_bias [1], v_weight [DV, H], v_bias [DV]
    out, stats,  # X' [T, H, DV]; [T, NS] r_k, r_x, beta, w.xn, v [DV], p [DV]
    T, H, v_scale, eps, k_eps2,
    DV: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    BDV: tl.constexpr, ACC: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = tl.arange(0, BDV)
    m_d = o_d < DV

    s_yy = tl.zeros([BT], dtype=ACC)
    s_xx = tl.zeros([BT], dtype=ACC)
    s_xw = tl.zeros([BT], dtype=ACC)
    s_u = tl.zeros([BT, BDV], dtype=ACC)
    s_yx = tl.zeros([BT, BDV], dtype=ACC)
    for h0 in range(0, H, BH):
        o_h = h0 + tl.arange(0, BH)
        m_h = o_h < H
        m_th = m_t[:, None] & m_h[None, :]
        o_row = o_t[:, None] * H + o_h[None, :]
        b_y = tl.load(y + o_row, mask=m_th, other=0.).to(ACC)
        b_xin = tl.load(xin + o_row, mask=m_th, other=0.).to(ACC)
        b_wb = tl.load(wb + o_h, mask=m_h, other=0.).to(ACC)
        b_wv = tl.load(wv + o_d[None, :] * H + o_h[:, None], mask=m_h[:, None] & m_d[None, :],
                       other=0.).to(ACC)  # [BH, BDV]
        b_x = tl.load(x + _tile3(o_t, o_h, o_d, H, DV),
                      mask=m_th[:, :, None] & m_d[None, None, :], other=0.).to(ACC)
        s_yy += tl.sum(b_y * b_y, axis=1)
        s_xx += tl.sum(b_xin * b_xin, axis=1)
        s_xw += tl.sum(b_xin * b_wb[None, :], axis=1)
        s_u += tl.sum(b_xin[:, :, None] * b_wv[None, :, :], axis=1)
        s_yx += tl.sum(b_y[:, :, None] * b_x, axis=1)

    r_k = 1. / tl.sqrt(s_yy + k_eps2)
    r_x = 1. / tl.sqrt(s_xx / H + eps)
    wxn = s_xw * r_x
    beta = 2. * tl.sigmoid(wxn + tl.load(bb).to(ACC))
    b_bv = tl.load(bv + o_d, mask=m_d, other=0.).to(ACC)
    v = v_scale * tl.sigmoid(s_u + b_bv[None, :])
    p = s_yx * r_k[:, None]
    delta = beta[:, None] * (v - p)  # [BT, BDV]

    o_s = o_t * NS
    tl.store(stats + o_s, r_k, mask=m_t)
    tl.store(stats + o_s + 1, r_x, mask=m_t)
    tl.store(stats + o_s + 2, beta, mask=m_t)
    tl.store(stats + o_s + 3, wxn, mask=m_t)
    m_td = m_t[:, None] & m_d[None, :]
    tl.store(stats + o_s[:, None] + 4 + o_d[None, :], v, mask=m_td)
    tl.store(stats + o_s[:, None] + 4 + DV + o_d[None, :], p, mask=m_td)
    # the backward's room: defined values, so that the output is deterministic
    zeros = tl.zeros([BT, BDV], dtype=ACC)
    tl.store(stats + o_s[:, None] + 4 + 2 * DV + o_d[None, :], zeros, mask=m_td)
    tl.store(stats + o_s[:, None] + 4 + 3 * DV + o_d[None, :], zeros,
             mask=m_t[:, None] & (o_d < 2)[None, :])

    for h0 in range(0, H, BH):
        o_h = h0 + tl.arange(0, BH)
        m_th = m_t[:, None] & (o_h < H)[None, :]
        m = m_th[:, :, None] & m_d[None, None, :]
        o_x = _tile3(o_t, o_h, o_d, H, DV)
        b_k = tl.load(y + o_t[:, None] * H + o_h[None, :], mask=m_th, other=0.).to(ACC)
        b_k *= r_k[:, None]
        b_x = tl.load(x + o_x, mask=m, other=0.).to(ACC)
        b_x += b_k[:, :, None] * delta[:, None, :]
        tl.store(out + o_x, b_x.to(out.dtype.element_ty), mask=m)


@triton.jit
def ddl_write_bwd_kernel(
    x, y, xin, wb, wv, stats, g,  # forward inputs, saved statistics, dL/dX' [T, H, DV]
    dx, dy, dxin, tok,  # gradients; tok: per token dl, dl r_x, du at tok + t * TS + T0
    T, H, v_scale, TS, T0,
    DV: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    BDV: tl.constexpr, ACC: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = tl.arange(0, BDV)
    m_d = o_d < DV
    m_td = m_t[:, None] & m_d[None, :]

    o_s = o_t * NS
    r_k = tl.load(stats + o_s, mask=m_t, other=0.)
    r_x = tl.load(stats + o_s + 1, mask=m_t, other=0.)
    beta = tl.load(stats + o_s + 2, mask=m_t, other=0.)
    wxn = tl.load(stats + o_s + 3, mask=m_t, other=0.)
    v = tl.load(stats + o_s[:, None] + 4 + o_d[None, :], mask=m_td, other=0.)
    p = tl.load(stats + o_s[:, None] + 4 + DV + o_d[None, :], mask=m_td, other=0.)

    # pass A: d delta = k^T G
    s_kg = tl.zeros([BT, BDV], dtype=ACC)
    for h0 in range(0, H, BH):
        o_h = h0 + tl.arange(0, BH)
        m_th = m_t[:, None] & (o_h < H)[None, :]
        b_y = tl.load(y + o_t[:, None] * H + o_h[None, :], mask=m_th, other=0.).to(ACC)
        b_g = tl.load(g + _tile3(o_t, o_h, o_d, H, DV),
                      mask=m_th[:, :, None] & m_d[None, None, :], other=0.).to(ACC)
        s_kg += tl.sum(b_y[:, :, None] * b_g, axis=1)
    ddelta = s_kg * r_k[:, None]
    delta = beta[:, None] * (v - p)
    dp = -beta[:, None] * ddelta
    dl = tl.sum(ddelta * (v - p), axis=1) * beta * (1. - 0.5 * beta)
    du = beta[:, None] * ddelta * v * (1. - v / v_scale)
    kdk = tl.sum(ddelta * delta + p * dp, axis=1)

    o_tok = o_t * TS + T0
    tl.store(tok + o_tok, dl, mask=m_t)
    tl.store(tok + o_tok + 1, dl * r_x, mask=m_t)
    tl.store(tok + o_tok[:, None] + 2 + o_d[None, :], du, mask=m_td)

    # pass B: every gradient of a token row
    for h0 in range(0, H, BH):
        o_h = h0 + tl.arange(0, BH)
        m_h = o_h < H
        m_th = m_t[:, None] & m_h[None, :]
        m = m_th[:, :, None] & m_d[None, None, :]
        o_row = o_t[:, None] * H + o_h[None, :]
        o_x = _tile3(o_t, o_h, o_d, H, DV)
        b_k = tl.load(y + o_row, mask=m_th, other=0.).to(ACC) * r_k[:, None]
        b_g = tl.load(g + o_x, mask=m, other=0.).to(ACC)
        b_x = tl.load(x + o_x, mask=m, other=0.).to(ACC)
        tl.store(dx + o_x, (b_g + b_k[:, :, None] * dp[:, None, :]).to(dx.dtype.element_ty),
                 mask=m)
        b_dk = tl.sum(b_g * delta[:, None, :] + b_x * dp[:, None, :], axis=2)
        b_dy = r_k[:, None] * (b_dk - b_k * kdk[:, None])
        tl.store(dy + o_row, b_dy.to(dy.dtype.element_ty), mask=m_th)
        b_xn = tl.load(xin + o_row, mask=m_th, other=0.).to(ACC) * r_x[:, None]
        b_wb = tl.load(wb + o_h, mask=m_h, other=0.).to(ACC)
        b_wv = tl.load(wv + o_d[None, :] * H + o_h[:, None], mask=m_h[:, None] & m_d[None, :],
                       other=0.).to(ACC)  # [BH, BDV]
        b_dxin = (tl.sum(b_wv[None, :, :] * du[:, None, :], axis=2)
                  + (r_x * dl)[:, None] * (b_wb[None, :] - b_xn * (wxn / H)[:, None]))
        tl.store(dxin + o_row, b_dxin.to(dxin.dtype.element_ty), mask=m_th)


@triton.jit
def ddl_write_params_kernel(
    xin, tok,  # [T, H]; what the backward wrote at tok + t * TS + T0
    dparams,  # [H (dw_beta) + DV H (dW_v) + 1 (db_beta) + DV (db_v)] in the params' dtype
    T, H, TS, T0,
    DV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr,
    ACC: tl.constexpr,
):
    i_h = tl.program_id(0)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < H
    o_d = tl.arange(0, BDV)
    m_d = o_d < DV
    acc_w = tl.zeros([BT, BH], dtype=ACC)
    acc_v = tl.zeros([BH, BDV], dtype=ACC)
    acc_b = tl.zeros([BT], dtype=ACC)
    acc_bv = tl.zeros([BT, BDV], dtype=ACC)
    for t0 in range(0, T, BT):
        o_t = (t0 + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < T
        o_tok = o_t * TS + T0
        b_xin = tl.load(xin + o_t[:, None] * H + o_h[None, :],
                        mask=m_t[:, None] & m_h[None, :], other=0.).to(ACC)
        b_dl = tl.load(tok + o_tok, mask=m_t, other=0.)
        b_dlr = tl.load(tok + o_tok + 1, mask=m_t, other=0.)
        b_du = tl.load(tok + o_tok[:, None] + 2 + o_d[None, :], mask=m_t[:, None] & m_d[None, :],
                       other=0.)
        acc_w += b_dlr[:, None] * b_xin
        acc_v += tl.sum(b_xin[:, :, None] * b_du[:, None, :], axis=0)
        acc_b += b_dl
        acc_bv += b_du
    ty = dparams.dtype.element_ty
    tl.store(dparams + o_h, tl.sum(acc_w, axis=0).to(ty), mask=m_h)
    tl.store(dparams + H + o_d[None, :] * H + o_h[:, None], acc_v.to(ty),
             mask=m_h[:, None] & m_d[None, :])
    if i_h == 0:
        tl.store(dparams + H * (DV + 1), tl.sum(acc_b, axis=0).to(ty))
        tl.store(dparams + H * (DV + 1) + 1 + o_d, tl.sum(acc_bv, axis=0).to(ty), mask=m_d)


# ---------------------------------------------------------------------------------------
# Host launchers
# ---------------------------------------------------------------------------------------


# The interpreter runs programs one by one in numpy: few, large tiles there (still more
# than one chunk of h in the update for h > 128, more than one token tile above 32 tokens).
@host_cache
def _read_tiles(h: int, bdv: int) -> Tuple[int, int]:
    """(BT, BH) of the read kernels: about 2K state elements a program."""
    if interpreting():
        return 32, next_power_of_2(h)
    bh = min(next_power_of_2(h), max(16, 256 // bdv))
    return max(1, 2048 // (bh * bdv)), bh


@host_cache
def _write_tiles(h: int, bdv: int) -> Tuple[int, int]:
    """(BT, BH) of the update kernels: ``[BT, BH, BDV]`` chunks of about 2K elements."""
    if interpreting():
        return 32, min(next_power_of_2(h), 128)
    bh = min(next_power_of_2(h), max(16, 512 // bdv))
    return max(1, min(16, 2048 // (bh * bdv))), bh


@host_cache
def _params_tiles(h: int) -> int:
    """BH of the parameter-gradient kernel: one program per 16 hidden columns."""
    return min(next_power_of_2(h), 128 if interpreting() else 16)


@host_cache
def _bdv(dv: int) -> int:
    return max(2, next_power_of_2(dv))


def ddl_read_fwd(x: Tensor, read: Tensor) -> Tensor:
    """``x [..., h, d_v]`` (contiguous) -> ``x_in [..., h]`` in ``x``'s dtype."""
    *lead, h, dv = x.shape
    t = x.numel() // (h * dv)
    out = x.new_empty((*lead, h))
    bdv = _bdv(dv)
    bt, bh = _read_tiles(h, bdv)
    ddl_read_fwd_kernel[(cdiv(t, bt), cdiv(h, bh))](
        x, read, out, t, h, DV=dv, BT=bt, BH=bh, BDV=bdv, ACC=tl_dtype(acc_dtype(x.dtype)),
        num_warps=4)
    return out


def ddl_read_bwd(x: Tensor, read: Tensor, grad: Tensor) -> Tuple[Tensor, Tensor]:
    """``(dx, dread)`` for ``grad [..., h]`` (contiguous)."""
    h, dv = x.shape[-2:]
    t = x.numel() // (h * dv)
    acc = acc_dtype(x.dtype)
    bdv = _bdv(dv)
    bt, bh = _read_tiles(h, bdv)
    grid = (cdiv(t, bt), cdiv(h, bh))
    dx = torch.empty_like(x)
    partial = x.new_empty((grid[0] * grid[1], dv), dtype=acc)
    ddl_read_bwd_kernel[grid](x, read, grad, dx, partial, t, h, DV=dv, BT=bt, BH=bh,
                              BDV=bdv, ACC=tl_dtype(acc), num_warps=4)
    return dx, partial.sum(0).to(read.dtype)  # fixed-order sum of the partials


def ddl_write_fwd(x: Tensor, y: Tensor, x_in: Tensor, beta_weight: Tensor, beta_bias: Tensor,
                  v_weight: Tensor, v_bias: Tensor, v_scale: float, eps: float
                  ) -> Tuple[Tensor, Tensor]:
    """``(X' [..., h, d_v], stats [..., 4 + 2 d_v])``, all inputs contiguous; ``stats[..., 2]``
    is beta."""
    *lead, h, dv = x.shape
    t = x.numel() // (h * dv)
    acc = acc_dtype(x.dtype)
    ns = stats_width(dv)
    out = torch.empty_like(x)
    stats = x.new_empty((*lead, ns), dtype=acc)
    bdv = _bdv(dv)
    bt, bh = _write_tiles(h, bdv)
    ddl_write_fwd_kernel[(cdiv(t, bt),)](
        x, y, x_in, beta_weight, beta_bias, v_weight, v_bias, out, stats,
        t, h, v_scale, eps, K_EPS**2,
        DV=dv, NS=ns, BT=bt, BH=bh, BDV=bdv, ACC=tl_dtype(acc), num_warps=4)
    return out, stats


def ddl_write_bwd(x: Tensor, y: Tensor, x_in: Tensor, beta_weight: Tensor, v_weight: Tensor,
                  stats: Tensor, v_scale: float, grad: Tensor, in_stats: bool = False,
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dy, dx_in, dparams)`` for ``grad = dL/dX'`` (contiguous); ``dparams`` is one
    buffer in the parameters' dtype: ``dw_beta [h] | dW_v [d_v, h] | db_beta [1] | db_v [d_v]``
    (:func:`split_params`). ``in_stats``: the per-token intermediates go to the columns
    ``stats`` keeps for them (a custom op may not write its inputs, an
    ``autograd.Function``'s backward may: every backward writes them before reading)."""
    h, dv = x.shape[-2:]
    t = x.numel() // (h * dv)
    acc = acc_dtype(x.dtype)
    bdv = _bdv(dv)
    bt, bh = _write_tiles(h, bdv)
    dx, dy, dx_in = torch.empty_like(x), torch.empty_like(y), torch.empty_like(x_in)
    if in_stats:
        tok, ts, t0 = stats, stats_width(dv), saved_width(dv)
    else:
        tok, ts, t0 = x.new_empty((t, 2 + dv), dtype=acc), 2 + dv, 0
    ddl_write_bwd_kernel[(cdiv(t, bt),)](
        x, y, x_in, beta_weight, v_weight, stats, grad, dx, dy, dx_in, tok, t, h, v_scale, ts, t0,
        DV=dv, NS=stats_width(dv), BT=bt, BH=bh, BDV=bdv, ACC=tl_dtype(acc), num_warps=4)
    dparams = beta_weight.new_empty(h * (dv + 1) + 1 + dv)
    bhp = _params_tiles(h)
    ddl_write_params_kernel[(cdiv(h, bhp),)](
        x_in, tok, dparams, t, h, ts, t0, DV=dv, BT=64, BH=bhp, BDV=bdv, ACC=tl_dtype(acc),
        num_warps=4)
    return dx, dy, dx_in, dparams


def split_params(dparams: Tensor, h: int, dv: int
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dparams`` of :func:`ddl_write_bwd` as ``(dw_beta [h], db_beta [1], dW_v [d_v, h],
    db_v [d_v])`` views."""
    dw, dwv, db, dbv = dparams.split_with_sizes((h, dv * h, 1, dv))
    return dw, db, dwv.view(dv, h), dbv


def check_write(x: Tensor, beta_weight: Tensor, *params: Optional[Tensor]) -> None:
    """The update's parameters share one dtype: their gradients are one buffer."""
    dtype = beta_weight.dtype
    if all(p.dtype is dtype for p in params):
        return
    for p in params:
        if p.dtype != beta_weight.dtype:
            raise ValueError(f"ddl write: parameters of dtypes {beta_weight.dtype} and "
                             f"{p.dtype}; the kernel takes one")
