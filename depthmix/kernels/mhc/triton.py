"""mHC stream mixing: Triton kernels, then host launchers.

Two launches per sublayer forward (``reference.py`` has the math):

1. :func:`mhc_read_fwd` (``mhc_read_fwd_kernel``), one program per tile of ``BT`` tokens:
   pass 1 over the flattened streams ``X [BT, n*h]`` accumulates the sum of squares and the
   coefficient projection ``X phi`` (``tl.dot``; RMSNorm commutes with the projection:
   ``RMSNorm(X) phi = rstd * (X phi)``), then in registers: gates, static biases,
   sigmoid / 2 sigmoid / tanh and the Sinkhorn-Knopp projection of the ``n x n`` logits;
   pass 2 over ``X`` forms ``H_pre X``. Coefficients and Sinkhorn are fp32 (fp64 for fp64).
   With a ``norm_weight`` it writes the sublayer's input RMSNorm of ``H_pre X`` instead
   (``x rsqrt(mean(x^2) + eps) w``, fp32): one more pass over ``X`` (a tile the program has
   just read) gives the row statistic first, so ``H_pre X`` itself never goes to memory.
2. :func:`mhc_post_res_fwd` (``mhc_post_res_fwd_kernel``), tiles of tokens x hidden:
   ``X' = H_res X + H_post^T y``, every stream read once.

Backward: ``mhc_post_res_bwd_kernel`` (one launch: ``dX``, ``dy`` and the per-token
``dH_post``, ``dH_res`` reduced over the hidden in registers); ``mhc_read_bwd_coef_kernel``
(per token tile: ``dH_pre = X . dx_in``, the coefficient/Sinkhorn backward, per-tile partial
sums of the gate and bias gradients; with the norm it recomputes ``H_pre X`` and writes
its gradient and the norm weight's per-tile partial sums) and ``mhc_read_bwd_x_kernel``
(per block of ``phi`` rows and chunk of tokens: ``dX`` and the ``dphi`` partial sum of the
chunk). Every reduction over tokens is a fixed-order partial sum, finished by one
``torch.sum`` over the partials: deterministic, no atomics.

Sinkhorn backward: the exact gradient of the fixed-iteration map (what the forward
computes), by reverse-mode through the iterations, **recomputing** the iterate an
iteration needs from the initial matrix instead of storing it: ``K(K-1)/2`` recomputed
iterations of an ``n x n`` matrix in registers (190 for ``K = 20``), no workspace.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from depthmix.kernels._common import (
    acc_dtype,
    built_interpreted,
    cdiv,
    host_cache,
    next_power_of_2,
    sm_count,
    tl_dtype,
)

VARIANT_IDS = {"mhc": 0, "hc": 1, "identity": 2}


# ---------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    """tanh from exp (the interpreter has no libdevice): the odd Taylor series to x^13 below
    |x| = 0.1 (error < 1e-17 relative), ``(1 - e^{-2|x|}) / (1 + e^{-2|x|})`` above."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    p = 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    small = x + x * x2 * p
    return tl.where(ax < 0.1, small, tl.where(x < 0, -big, big))


@triton.jit
def _sinkhorn_init(z, valid, row_valid):
    """``exp(z - rowmax)`` of logits ``z [B, NP, NP]``; padded entries are 0."""
    z = tl.where(valid, z, float("-inf"))
    zmax = tl.where(row_valid, tl.max(z, axis=2), 0.0)
    return tl.where(valid, tl.exp(z - zmax[:, :, None]), 0.0)


@triton.jit
def _sinkhorn_iterate(m, row_valid, col_valid, iters):
    """``iters`` times: normalise the rows, then the columns (padded sums count as 1)."""
    for _ in range(iters):
        r = tl.where(row_valid, tl.sum(m, axis=2), 1.0)
        m = m / r[:, :, None]
        c = tl.where(col_valid, tl.sum(m, axis=1), 1.0)
        m = m / c[:, None, :]
    return m


@triton.jit
def _sinkhorn_bwd(e0, g, row_valid, col_valid, iters):
    """Gradient w.r.t. the initial matrix ``e0`` of ``_sinkhorn_iterate(e0, iters)`` given
    the gradient ``g`` of its output. Iteration ``it`` (last first) recomputes its input
    from ``e0`` (``it`` iterations), then inverts its two normalisations:
    ``out = m / s``  ->  ``dm = (dout - sum(dout * out)) / s`` along the normalised axis."""
    for step in range(iters):
        it = iters - 1 - step
        m = _sinkhorn_iterate(e0, row_valid, col_valid, it)
        r = tl.where(row_valid, tl.sum(m, axis=2), 1.0)
        a = m / r[:, :, None]
        c = tl.where(col_valid, tl.sum(a, axis=1), 1.0)
        p = a / c[:, None, :]
        ga = (g - tl.sum(g * p, axis=1)[:, None, :]) / c[:, None, :]
        g = (ga - tl.sum(ga * a, axis=2)[:, :, None]) / r[:, :, None]
    return g


# ---------------------------------------------------------------------------------------
# Sinkhorn-Knopp on its own: logits [R, n, n]
# ---------------------------------------------------------------------------------------


@triton.jit
def sinkhorn_fwd_kernel(z_ptr, out_ptr, R, iters,
                        N: tl.constexpr, NP: tl.constexpr, ACC: tl.constexpr,
                        BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    i = tl.arange(0, NP)
    row_valid = (i < N)[None, :]
    valid = (i < N)[None, :, None] & (i < N)[None, None, :]
    mask = (r < R)[:, None, None] & valid
    offs = r.to(tl.int64)[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(ACC)
    m = _sinkhorn_iterate(_sinkhorn_init(z, valid, row_valid), row_valid, row_valid, iters)
    tl.store(out_ptr + offs, m, mask=mask)


@triton.jit
def sinkhorn_bwd_kernel(z_ptr, g_ptr, dz_ptr, R, iters,
                        N: tl.constexpr, NP: tl.constexpr, ACC: tl.constexpr,
                        BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    i = tl.arange(0, NP)
    row_valid = (i < N)[None, :]
    valid = (i < N)[None, :, None] & (i < N)[None, None, :]
    mask = (r < R)[:, None, None] & valid
    offs = r.to(tl.int64)[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(ACC)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
    e0 = _sinkhorn_init(z, valid, row_valid)
    ge = _sinkhorn_bwd(e0, g, row_valid, row_valid, iters)
    # d exp(z - max) / dz = e0; the row max is treated as a constant (the map is exactly
    # invariant to per-row shifts, so its gradient path contributes nothing).
    tl.store(dz_ptr + offs, ge * e0, mask=mask)


# ---------------------------------------------------------------------------------------
# Launch 1: RMSNorm + projection + coefficients + Sinkhorn + H_pre X
# ---------------------------------------------------------------------------------------
# Column layouts of the coefficient logits (m per token; reference.py: pre | post | res):
#   "pp"  [P2]      column c < 2n is logit c (pre for c < n, post for n <= c < 2n);
#   "res" [NP, NP]  entry (i, j) with i, j < n is logit 2n + i n + j (flattened to NP*NP
#                   for tl.dot; NP >= 4 so that NP*NP >= 16, tl.dot's minimum width).


@triton.jit
def _pre_chunk(x_ptr, w_pre, t64, t_mask, s_i, h0, H, N: tl.constexpr, BH: tl.constexpr):
    """``(x_in, h, h_mask)``: ``sum_i H_pre[i] X[i]`` on hidden channels ``h0 .. h0 + BH``
    of a token tile, ``w_pre [BT, NP]``."""
    h = h0 + tl.arange(0, BH)
    h_mask = h < H
    x = tl.load(x_ptr + t64[:, None, None] * (N * H) + s_i[None, :, None] * H + h[None, None, :],
                mask=t_mask[:, None, None] & (s_i < N)[None, :, None] & h_mask[None, None, :],
                other=0.0).to(w_pre.dtype)
    return tl.sum(w_pre[:, :, None] * x, axis=1), h, h_mask


@triton.jit
def mhc_read_fwd_kernel(
    x_ptr, phi_ptr, alpha_ptr, bias_ptr, nw_ptr,
    xin_ptr, hpre_ptr, hpost_ptr, hres_ptr, dyn_ptr, rstd_ptr,
    T, H, eps, norm_eps, iters,
    N: tl.constexpr, M: tl.constexpr, NP: tl.constexpr, P2: tl.constexpr,
    VARIANT: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, NORM: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_mask = t < T
    t64 = t.to(tl.int64)
    K = N * H
    c = tl.arange(0, P2)
    pp_mask = c < 2 * N
    rc = tl.arange(0, NP * NP)
    res_mask = (rc // NP < N) & (rc % NP < N)
    res_col = 2 * N + (rc // NP) * N + rc % NP

    # pass 1: sum of squares and X phi over the flattened streams
    ssq = tl.zeros([BT], dtype=ACC)
    acc_pp = tl.zeros([BT, P2], dtype=ACC)
    acc_res = tl.zeros([BT, NP * NP], dtype=ACC)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_mask = k < K
        x = tl.load(x_ptr + t64[:, None] * K + k[None, :],
                    mask=t_mask[:, None] & k_mask[None, :], other=0.0).to(ACC)
        ssq += tl.sum(x * x, axis=1)
        w = tl.load(phi_ptr + k[:, None] * M + c[None, :],
                    mask=k_mask[:, None] & pp_mask[None, :], other=0.0).to(ACC)
        acc_pp = tl.dot(x, w, acc_pp, input_precision=DOT_PREC)
        if VARIANT != 2:
            w = tl.load(phi_ptr + k[:, None] * M + res_col[None, :],
                        mask=k_mask[:, None] & res_mask[None, :], other=0.0).to(ACC)
            acc_res = tl.dot(x, w, acc_res, input_precision=DOT_PREC)
    rstd = 1.0 / tl.sqrt(ssq / K + eps)
    tl.store(rstd_ptr + t, rstd, mask=t_mask)

    # coefficients: pre | post
    d_pp = acc_pp * rstd[:, None]
    tl.store(dyn_ptr + t64[:, None] * M + c[None, :], d_pp,
             mask=t_mask[:, None] & pp_mask[None, :])
    is_pre = c < N
    a_pp = tl.where(is_pre, tl.load(alpha_ptr).to(ACC), tl.load(alpha_ptr + 1).to(ACC))
    b_pp = tl.load(bias_ptr + c, mask=pp_mask, other=0.0).to(ACC)
    if VARIANT == 0:
        s = tl.sigmoid(a_pp[None, :] * d_pp + b_pp[None, :])
        h_pp = tl.where(is_pre[None, :], s, 2.0 * s)
    else:
        h_pp = b_pp[None, :] + a_pp[None, :] * _tanh(d_pp)
    tl.store(hpre_ptr + t64[:, None] * N + c[None, :], h_pp,
             mask=t_mask[:, None] & is_pre[None, :])
    tl.store(hpost_ptr + t64[:, None] * N + (c[None, :] - N), h_pp,
             mask=t_mask[:, None] & (pp_mask & ~is_pre)[None, :])

    # coefficients: res (Sinkhorn or tanh)
    if VARIANT != 2:
        d_res = acc_res * rstd[:, None]
        tl.store(dyn_ptr + t64[:, None] * M + res_col[None, :], d_res,
                 mask=t_mask[:, None] & res_mask[None, :])
        i = tl.arange(0, NP)
        valid = (i < N)[None, :, None] & (i < N)[None, None, :]
        res_off = 2 * N + i[:, None] * N + i[None, :]
        b_res = tl.load(bias_ptr + res_off, mask=(i < N)[:, None] & (i < N)[None, :],
                        other=0.0).to(ACC)
        a_res = tl.load(alpha_ptr + 2).to(ACC)
        d3 = tl.reshape(d_res, (BT, NP, NP))
        if VARIANT == 0:
            row_valid = (i < N)[None, :]
            e0 = _sinkhorn_init(a_res * d3 + b_res[None, :, :], valid, row_valid)
            h_res = _sinkhorn_iterate(e0, row_valid, row_valid, iters)
        else:
            h_res = b_res[None, :, :] + a_res * _tanh(d3)
        out_off = t64[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
        tl.store(hres_ptr + out_off, h_res, mask=t_mask[:, None, None] & valid)

    # pass 2: x_in = sum_i H_pre[i] X[i]   (H_pre moved from the pp layout to [BT, NP]);
    # NORM: the sublayer's RMSNorm, its row statistic from one more pass over X first
    s_i = tl.arange(0, NP)
    w_pre = tl.sum(tl.where(s_i[None, :, None] == c[None, None, :], h_pp[:, None, :], 0.0),
                   axis=2)
    if NORM:
        ssq_in = tl.zeros([BT], dtype=ACC)
        for h0 in range(0, H, BH):
            x_in, h, h_mask = _pre_chunk(x_ptr, w_pre, t64, t_mask, s_i, h0, H, N, BH)
            ssq_in += tl.sum(x_in * x_in, axis=1)
        rho = 1.0 / tl.sqrt(ssq_in / H + norm_eps)
    for h0 in range(0, H, BH):
        x_in, h, h_mask = _pre_chunk(x_ptr, w_pre, t64, t_mask, s_i, h0, H, N, BH)
        if NORM:
            w = tl.load(nw_ptr + h, mask=h_mask, other=0.0).to(ACC)
            x_in = x_in * rho[:, None] * w[None, :]
        tl.store(xin_ptr + t64[:, None] * H + h[None, :], x_in.to(xin_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & h_mask[None, :])


@triton.jit
def mhc_read_bwd_coef_kernel(
    x_ptr, gxin_ptr, gpre_ptr, gpost_ptr, gres_ptr, dyn_ptr, rstd_ptr, alpha_ptr, bias_ptr,
    hpre_ptr, nw_ptr, gin_ptr,
    dds_ptr, coef_ptr, part_ptr,
    T, H, part_width, norm_eps, iters,
    N: tl.constexpr, M: tl.constexpr, NP: tl.constexpr, P2: tl.constexpr,
    VARIANT: tl.constexpr, ACC: tl.constexpr, NORM: tl.constexpr,
    HAS_GPRE: tl.constexpr, HAS_GPOST: tl.constexpr, HAS_GRES: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr,
):
    """Per token: ``dd`` (gradient of the dynamic logits ``d = RMSNorm(X) phi``); stores
    ``rstd * dd`` and the RMSNorm correction ``rstd^2 (dd . d) / (n h)``, and this tile's
    partial sums of the gate (3) and bias (m) gradients (a row of ``part``).

    NORM (the output went through ``RMSNorm(x_in) * w``; ``gxin`` is its gradient): two
    passes over the hidden recompute ``x_in``; the first gives ``rho = rsqrt(mean(x_in^2) +
    eps)`` and ``c = mean(x_in * g * w)``, the second the gradient of ``x_in``,
    ``rho g w - rho^3 c x_in`` (stored for the dX kernel), and this tile's partial sum of
    the weight's gradient ``sum_t g x_in rho`` (``h`` more columns of ``part``)."""
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    t_mask = t < T
    t64 = t.to(tl.int64)
    K = N * H
    s_i = tl.arange(0, NP)
    c = tl.arange(0, P2)
    pp_mask = c < 2 * N
    is_pre = c < N

    # dH_pre = X . dx_in (over the hidden), plus any direct gradient of H_pre
    dh_pre = tl.zeros([BT, NP], dtype=ACC)
    if NORM:
        w_pre = tl.load(hpre_ptr + t64[:, None] * N + s_i[None, :],
                        mask=t_mask[:, None] & (s_i < N)[None, :], other=0.0).to(ACC)
        ssq = tl.zeros([BT], dtype=ACC)
        cg = tl.zeros([BT], dtype=ACC)
        for h0 in range(0, H, BH):
            x_in, h, h_mask = _pre_chunk(x_ptr, w_pre, t64, t_mask, s_i, h0, H, N, BH)
            g = tl.load(gxin_ptr + t64[:, None] * H + h[None, :],
                        mask=t_mask[:, None] & h_mask[None, :], other=0.0).to(ACC)
            w = tl.load(nw_ptr + h, mask=h_mask, other=0.0).to(ACC)
            ssq += tl.sum(x_in * x_in, axis=1)
            cg += tl.sum(x_in * g * w[None, :], axis=1)
        rho = 1.0 / tl.sqrt(ssq / H + norm_eps)
        corr = rho * rho * rho * cg / H
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        h_mask = h < H
        x = tl.load(x_ptr + t64[:, None, None] * K + s_i[None, :, None] * H + h[None, None, :],
                    mask=t_mask[:, None, None] & (s_i < N)[None, :, None] & h_mask[None, None, :],
                    other=0.0).to(ACC)
        g = tl.load(gxin_ptr + t64[:, None] * H + h[None, :],
                    mask=t_mask[:, None] & h_mask[None, :], other=0.0).to(ACC)
        if NORM:
            x_in = tl.sum(w_pre[:, :, None] * x, axis=1)
            tl.store(part_ptr + pid * part_width + 3 + M + h,
                     tl.sum(g * x_in * rho[:, None], axis=0), mask=h_mask)
            w = tl.load(nw_ptr + h, mask=h_mask, other=0.0).to(ACC)
            g = rho[:, None] * g * w[None, :] - corr[:, None] * x_in
            # the dX kernel reads the stored gradient: both use the rounded one
            g = g.to(gin_ptr.dtype.element_ty)
            tl.store(gin_ptr + t64[:, None] * H + h[None, :], g,
                     mask=t_mask[:, None] & h_mask[None, :])
            g = g.to(ACC)
        dh_pre += tl.sum(x * g[:, None, :], axis=2)
    if HAS_GPRE:
        dh_pre += tl.load(gpre_ptr + t64[:, None] * N + s_i[None, :],
                          mask=t_mask[:, None] & (s_i < N)[None, :], other=0.0).to(ACC)
    # to the pp layout: column c < n from dh_pre, n <= c < 2n from the H_post gradient
    dh_pp = tl.sum(tl.where(s_i[None, :, None] == c[None, None, :], dh_pre[:, :, None], 0.0),
                   axis=1)
    if HAS_GPOST:
        dh_pp += tl.load(gpost_ptr + t64[:, None] * N + (c[None, :] - N),
                         mask=t_mask[:, None] & (pp_mask & ~is_pre)[None, :],
                         other=0.0).to(ACC)

    d_pp = tl.load(dyn_ptr + t64[:, None] * M + c[None, :],
                   mask=t_mask[:, None] & pp_mask[None, :], other=0.0).to(ACC)
    a_pre = tl.load(alpha_ptr).to(ACC)
    a_post = tl.load(alpha_ptr + 1).to(ACC)
    a_pp = tl.where(is_pre, a_pre, a_post)
    b_pp = tl.load(bias_ptr + c, mask=pp_mask, other=0.0).to(ACC)
    if VARIANT == 0:  # h = scale * sigmoid(a d + b)
        s = tl.sigmoid(a_pp[None, :] * d_pp + b_pp[None, :])
        dz = dh_pp * s * (1.0 - s) * tl.where(is_pre, 1.0, 2.0)[None, :]
        da_pp = dz * d_pp
        dd_pp = a_pp[None, :] * dz
    else:  # h = b + a tanh(d)
        th = _tanh(d_pp)
        dz = dh_pp
        da_pp = dh_pp * th
        dd_pp = a_pp[None, :] * dh_pp * (1.0 - th * th)
    dd_pp = tl.where(pp_mask[None, :], dd_pp, 0.0)
    row = pid * part_width
    tl.store(part_ptr + row + 3 + c, tl.sum(dz, axis=0), mask=pp_mask)
    tl.store(part_ptr + row, tl.sum(tl.sum(tl.where(is_pre[None, :], da_pp, 0.0), axis=1), axis=0))
    tl.store(part_ptr + row + 1,
             tl.sum(tl.sum(tl.where((pp_mask & ~is_pre)[None, :], da_pp, 0.0), axis=1), axis=0))
    rstd = tl.load(rstd_ptr + t, mask=t_mask, other=0.0).to(ACC)
    dot_dd = tl.sum(dd_pp * d_pp, axis=1)
    tl.store(dds_ptr + t64[:, None] * M + c[None, :], dd_pp * rstd[:, None],
             mask=t_mask[:, None] & pp_mask[None, :])

    if VARIANT != 2:
        mask2 = (s_i < N)[:, None] & (s_i < N)[None, :]
        valid = mask2[None, :, :]
        row_valid = (s_i < N)[None, :]
        mat = s_i[:, None] * N + s_i[None, :]
        mask3 = t_mask[:, None, None] & valid
        off3 = t64[:, None, None] * M + 2 * N + mat[None, :, :]
        d_res = tl.load(dyn_ptr + off3, mask=mask3, other=0.0).to(ACC)
        if HAS_GRES:
            g_res = tl.load(gres_ptr + t64[:, None, None] * (N * N) + mat[None, :, :],
                            mask=mask3, other=0.0).to(ACC)
        else:
            g_res = tl.zeros([BT, NP, NP], dtype=ACC)
        a_res = tl.load(alpha_ptr + 2).to(ACC)
        b_res = tl.load(bias_ptr + 2 * N + mat, mask=mask2, other=0.0).to(ACC)
        if VARIANT == 0:
            e0 = _sinkhorn_init(a_res * d_res + b_res[None, :, :], valid, row_valid)
            dz_res = _sinkhorn_bwd(e0, g_res, row_valid, row_valid, iters) * e0
            da_res = dz_res * d_res
            dd_res = a_res * dz_res
        else:
            th = _tanh(d_res)
            dz_res = g_res
            da_res = g_res * th
            dd_res = a_res * g_res * (1.0 - th * th)
        dz_res = tl.where(mask3, dz_res, 0.0)
        dd_res = tl.where(mask3, dd_res, 0.0)
        da_res = tl.where(mask3, da_res, 0.0)
        tl.store(part_ptr + row + 3 + 2 * N + mat, tl.sum(dz_res, axis=0),
                 mask=mask2)
        tl.store(part_ptr + row + 2, tl.sum(tl.sum(tl.sum(da_res, axis=2), axis=1), axis=0))
        dot_dd += tl.sum(tl.sum(dd_res * d_res, axis=2), axis=1)
        tl.store(dds_ptr + off3, dd_res * rstd[:, None, None], mask=mask3)
    tl.store(coef_ptr + t, rstd * rstd * dot_dd / K, mask=t_mask)


@triton.jit
def mhc_read_bwd_x_kernel(
    x_ptr, gxin_ptr, hpre_ptr, dds_ptr, coef_ptr, phi_ptr, dx_ptr, dphi_ptr,
    T, H, tiles_per_chunk,
    N: tl.constexpr, M: tl.constexpr, NP: tl.constexpr, P2: tl.constexpr,
    VARIANT: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr,
):
    """Program (block of ``BH`` hidden channels of stream ``i``, chunk of token tiles):
    ``dX = (rstd dd) phi^T - coef X + H_pre[i] dx_in`` for its tokens, and the chunk's
    partial ``dphi = X^T (rstd dd)`` for its rows of ``phi``."""
    nhb = tl.cdiv(H, BH)
    i = tl.program_id(0) // nhb
    h = (tl.program_id(0) % nhb) * BH + tl.arange(0, BH)
    h_mask = h < H
    chunk = tl.program_id(1)
    K = N * H
    k = i * H + h  # rows of phi = columns of the flattened streams
    c = tl.arange(0, P2)
    pp_mask = c < 2 * N
    rc = tl.arange(0, NP * NP)
    res_mask = (rc // NP < N) & (rc % NP < N)
    res_col = 2 * N + (rc // NP) * N + rc % NP
    phi_pp = tl.load(phi_ptr + k[:, None] * M + c[None, :],
                     mask=h_mask[:, None] & pp_mask[None, :], other=0.0).to(ACC)
    acc_pp = tl.zeros([BH, P2], dtype=ACC)
    if VARIANT != 2:
        phi_res = tl.load(phi_ptr + k[:, None] * M + res_col[None, :],
                          mask=h_mask[:, None] & res_mask[None, :], other=0.0).to(ACC)
        acc_res = tl.zeros([BH, NP * NP], dtype=ACC)
    first = chunk * tiles_per_chunk
    last = tl.minimum(first + tiles_per_chunk, tl.cdiv(T, BT))
    for tile in range(first, last):
        t = tile * BT + tl.arange(0, BT)
        t_mask = t < T
        t64 = t.to(tl.int64)
        mask = t_mask[:, None] & h_mask[None, :]
        x = tl.load(x_ptr + t64[:, None] * K + k[None, :], mask=mask, other=0.0).to(ACC)
        g = tl.load(gxin_ptr + t64[:, None] * H + h[None, :], mask=mask, other=0.0).to(ACC)
        w = tl.load(hpre_ptr + t64 * N + i, mask=t_mask, other=0.0).to(ACC)
        coef = tl.load(coef_ptr + t, mask=t_mask, other=0.0).to(ACC)
        dd_pp = tl.load(dds_ptr + t64[:, None] * M + c[None, :],
                        mask=t_mask[:, None] & pp_mask[None, :], other=0.0).to(ACC)
        dx = tl.dot(dd_pp, tl.trans(phi_pp), input_precision=DOT_PREC)
        acc_pp = tl.dot(tl.trans(x), dd_pp, acc_pp, input_precision=DOT_PREC)
        if VARIANT != 2:
            dd_res = tl.load(dds_ptr + t64[:, None] * M + res_col[None, :],
                             mask=t_mask[:, None] & res_mask[None, :], other=0.0).to(ACC)
            dx = tl.dot(dd_res, tl.trans(phi_res), dx, input_precision=DOT_PREC)
            acc_res = tl.dot(tl.trans(x), dd_res, acc_res, input_precision=DOT_PREC)
        dx += w[:, None] * g - coef[:, None] * x
        tl.store(dx_ptr + t64[:, None] * K + k[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
    out = dphi_ptr + chunk.to(tl.int64) * K * M + k[:, None] * M
    tl.store(out + c[None, :], acc_pp, mask=h_mask[:, None] & pp_mask[None, :])
    if VARIANT != 2:
        tl.store(out + res_col[None, :], acc_res, mask=h_mask[:, None] & res_mask[None, :])


# ---------------------------------------------------------------------------------------
# Launch 2: X' = H_res X + H_post^T y
# ---------------------------------------------------------------------------------------


@triton.jit
def mhc_post_res_fwd_kernel(
    x_ptr, y_ptr, hpost_ptr, hres_ptr, out_ptr, T, H,
    N: tl.constexpr, NP: tl.constexpr, HAS_RES: tl.constexpr, ACC: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr,
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    t_mask, h_mask = t < T, h < H
    t64 = t.to(tl.int64)
    s = tl.arange(0, NP)
    s_mask = s < N
    mask2 = t_mask[:, None] & h_mask[None, :]
    mask3 = t_mask[:, None, None] & s_mask[None, :, None] & h_mask[None, None, :]
    off3 = t64[:, None, None] * (N * H) + s[None, :, None] * H + h[None, None, :]
    y = tl.load(y_ptr + t64[:, None] * H + h[None, :], mask=mask2, other=0.0).to(ACC)
    w = tl.load(hpost_ptr + t64[:, None] * N + s[None, :],
                mask=t_mask[:, None] & s_mask[None, :], other=0.0).to(ACC)
    acc = w[:, :, None] * y[:, None, :]  # [BT, NP, BH]
    if HAS_RES:
        for j in tl.static_range(N):
            xj = tl.load(x_ptr + t64[:, None] * (N * H) + j * H + h[None, :], mask=mask2,
                         other=0.0).to(ACC)
            hj = tl.load(hres_ptr + t64[:, None] * (N * N) + s[None, :] * N + j,
                         mask=t_mask[:, None] & s_mask[None, :], other=0.0).to(ACC)
            acc += hj[:, :, None] * xj[:, None, :]
    else:
        acc += tl.load(x_ptr + off3, mask=mask3, other=0.0).to(ACC)
    tl.store(out_ptr + off3, acc.to(out_ptr.dtype.element_ty), mask=mask3)


@triton.jit
def mhc_post_res_bwd_kernel(
    x_ptr, y_ptr, hpost_ptr, hres_ptr, g_ptr, dx_ptr, dy_ptr, dhpost_ptr, dhres_ptr, T, H,
    N: tl.constexpr, NP: tl.constexpr, HAS_RES: tl.constexpr, ACC: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr,
):
    """Per token tile, looping over the hidden: ``dy = H_post . G``, ``dX = H_res^T G``
    (``G`` itself for ``H_res = I``, not written here), and ``dH_post = G . y``,
    ``dH_res = G X^T`` reduced over the hidden in registers."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_mask = t < T
    t64 = t.to(tl.int64)
    s = tl.arange(0, NP)
    s_mask = s < N
    w = tl.load(hpost_ptr + t64[:, None] * N + s[None, :],
                mask=t_mask[:, None] & s_mask[None, :], other=0.0).to(ACC)
    dw = tl.zeros([BT, NP], dtype=ACC)
    dres = tl.zeros([BT, NP, NP], dtype=ACC)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        h_mask = h < H
        mask2 = t_mask[:, None] & h_mask[None, :]
        mask3 = t_mask[:, None, None] & s_mask[None, :, None] & h_mask[None, None, :]
        g = tl.load(g_ptr + t64[:, None, None] * (N * H) + s[None, :, None] * H
                    + h[None, None, :], mask=mask3, other=0.0).to(ACC)
        y = tl.load(y_ptr + t64[:, None] * H + h[None, :], mask=mask2, other=0.0).to(ACC)
        tl.store(dy_ptr + t64[:, None] * H + h[None, :],
                 tl.sum(w[:, :, None] * g, axis=1).to(dy_ptr.dtype.element_ty), mask=mask2)
        dw += tl.sum(g * y[:, None, :], axis=2)
        if HAS_RES:
            for j in tl.static_range(N):
                xj = tl.load(x_ptr + t64[:, None] * (N * H) + j * H + h[None, :], mask=mask2,
                             other=0.0).to(ACC)
                hj = tl.load(hres_ptr + t64[:, None] * (N * N) + s[None, :] * N + j,
                             mask=t_mask[:, None] & s_mask[None, :], other=0.0).to(ACC)
                dxj = tl.sum(hj[:, :, None] * g, axis=1)
                tl.store(dx_ptr + t64[:, None] * (N * H) + j * H + h[None, :],
                         dxj.to(dx_ptr.dtype.element_ty), mask=mask2)
                col = tl.sum(g * xj[:, None, :], axis=2)  # dH_res[:, :, j]
                dres += tl.where(s[None, None, :] == j, col[:, :, None], 0.0)
    tl.store(dhpost_ptr + t64[:, None] * N + s[None, :], dw,
             mask=t_mask[:, None] & s_mask[None, :])
    if HAS_RES:
        tl.store(dhres_ptr + t64[:, None, None] * (N * N) + s[None, :, None] * N
                 + s[None, None, :], dres,
                 mask=t_mask[:, None, None] & s_mask[None, :, None] & s_mask[None, None, :])


# ---------------------------------------------------------------------------------------
# Host launchers
# ---------------------------------------------------------------------------------------


@host_cache
def _tl(dtype: torch.dtype):
    return tl_dtype(acc_dtype(dtype))


def _dot_precision(t: torch.Tensor) -> str:
    """fp32 operands on tensor cores with three TF32 passes (close to fp32 accuracy); the
    interpreter and fp64 compute exactly (the mode decides, as in :func:`_block_t`)."""
    return "ieee" if built_interpreted() or t.dtype == torch.float64 else "tf32x3"


@host_cache
def _pad(n: int) -> Tuple[int, int]:
    """(NP, P2): padded streams for the res block (NP*NP >= 16) and the pre|post width."""
    return max(4, next_power_of_2(n)), max(16, next_power_of_2(2 * n))


def _block_t(t: torch.Tensor) -> int:
    """Tokens per program: 32 compiled, 16 in the interpreter. Chosen by the mode, not by
    ``t.device``, so that ``tools/kernel_report.py`` (meta tensors) sees the GPU tiles."""
    return 16 if built_interpreted() else 32


def _rows(x: torch.Tensor) -> int:
    """The rows (tokens, matrices) of ``x [..., a, b]``: the launchers take any leading dims
    of a contiguous tensor, and allocate their outputs with them (no reshapes around)."""
    return x.numel() // (x.shape[-1] * x.shape[-2])


def sinkhorn_fwd(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """``logits [..., n, n]`` (contiguous) -> ``[..., n, n]`` fp32 (fp64 for fp64)."""
    R, n = _rows(logits), logits.shape[-1]
    out = torch.empty(logits.shape, dtype=acc_dtype(logits.dtype), device=logits.device)
    BR = 64
    sinkhorn_fwd_kernel[(cdiv(R, BR),)](
        logits, out, R, iters, N=n, NP=next_power_of_2(n), ACC=_tl(logits.dtype), BR=BR)
    return out


def sinkhorn_bwd(logits: torch.Tensor, grad: torch.Tensor, iters: int) -> torch.Tensor:
    R, n = _rows(logits), logits.shape[-1]
    dz = torch.empty(logits.shape, dtype=acc_dtype(logits.dtype), device=logits.device)
    BR = 64
    sinkhorn_bwd_kernel[(cdiv(R, BR),)](
        logits, grad, dz, R, iters, N=n, NP=next_power_of_2(n), ACC=_tl(logits.dtype),
        BR=BR)
    return dz.to(logits.dtype)


def mhc_read_fwd(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
                 variant: str, iters: int, eps: float,
                 norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 0.0):
    """``x [..., n, h]`` contiguous (``T`` tokens in its leading dims) -> ``x_in [..., h]``
    (x.dtype; ``RMSNorm(x_in) * norm_weight`` with a ``norm_weight [h]``), ``h_pre [..., n]``,
    ``h_post [..., n]``, ``h_res [..., n, n]`` or None, and for the backward the dynamic
    logits ``dyn [..., m]`` and ``rstd [...]`` (all fp32; fp64 for fp64 x)."""
    *lead, n, H = x.shape
    T = _rows(x)
    m = phi.shape[1]
    acc = acc_dtype(x.dtype)
    dev = x.device
    NP, P2 = _pad(n)
    x_in = torch.empty((*lead, H), dtype=x.dtype, device=dev)
    h_pre = torch.empty((*lead, n), dtype=acc, device=dev)
    h_post = torch.empty((*lead, n), dtype=acc, device=dev)
    has_res = variant != "identity"
    h_res = torch.empty((*lead, n, n), dtype=acc, device=dev) if has_res else h_post
    dyn = torch.empty((*lead, m), dtype=acc, device=dev)
    rstd = torch.empty(lead, dtype=acc, device=dev)
    BT = _block_t(x)
    norm = norm_weight is not None
    mhc_read_fwd_kernel[(cdiv(T, BT),)](
        x, phi, alpha, bias, norm_weight if norm else bias, x_in, h_pre, h_post, h_res, dyn,
        rstd, T, H, eps, norm_eps, iters,
        N=n, M=m, NP=NP, P2=P2, VARIANT=VARIANT_IDS[variant], ACC=_tl(x.dtype),
        DOT_PREC=_dot_precision(x), NORM=norm, BT=BT, BK=64, BH=64, num_warps=4)
    return x_in, h_pre, h_post, (h_res if has_res else None), dyn, rstd


def mhc_read_bwd(x, phi, alpha, bias, h_pre, dyn, rstd, g_xin, g_pre, g_post, g_res,
                 variant: str, iters: int, norm_weight=None, norm_eps: float = 0.0,
                 grads_as_views: bool = False):
    """Gradients ``(dx, dphi, dalpha, dbias, dnorm_weight or None)`` of :func:`mhc_read_fwd`
    (two launches, plus one sum over the per-tile partials of each parameter gradient).
    ``grads_as_views``: ``dalpha`` and ``dbias`` may be views of one buffer (not from a
    custom op)."""
    T, (n, H) = _rows(x), x.shape[-2:]
    m = phi.shape[1]
    acc = acc_dtype(x.dtype)
    dev = x.device
    NP, P2 = _pad(n)
    BT = _block_t(x)
    tiles = cdiv(T, BT)
    dds = torch.empty((T, m), dtype=acc, device=dev)
    coef = torch.empty((T,), dtype=acc, device=dev)
    norm = norm_weight is not None
    # every tile writes its whole row: alpha (3; identity: column 2 unused, dropped) | bias
    # (m) | with the norm, its weight (H)
    width = 3 + m + (H if norm else 0)
    part = torch.empty((tiles, width), dtype=acc, device=dev)
    dummy = dyn
    if norm:  # the coefficient kernel turns the normed input's gradient into x_in's
        g_norm, g_xin = g_xin, torch.empty_like(g_xin)
    mhc_read_bwd_coef_kernel[(tiles,)](
        x, g_norm if norm else g_xin, dummy if g_pre is None else g_pre,
        dummy if g_post is None else g_post, dummy if g_res is None else g_res, dyn, rstd,
        alpha, bias, h_pre, norm_weight if norm else bias, g_xin,
        dds, coef, part, T, H, width, norm_eps, iters,
        N=n, M=m, NP=NP, P2=P2, VARIANT=VARIANT_IDS[variant], ACC=_tl(x.dtype), NORM=norm,
        HAS_GPRE=g_pre is not None, HAS_GPOST=g_post is not None,
        HAS_GRES=g_res is not None, BT=BT, BH=64, num_warps=4)
    BH = 64
    blocks = n * cdiv(H, BH)
    # token chunks: enough programs to fill the GPU (two chunks in the interpreter, so the
    # partial-sum path is exercised by the CPU tests)
    chunks = max(1, min(tiles, cdiv(4 * sm_count(x.device), blocks))) if x.is_cuda \
        else min(tiles, 2)
    per_chunk = cdiv(tiles, chunks)
    chunks = cdiv(tiles, per_chunk)
    dx = torch.empty_like(x)
    dphi = torch.empty((chunks, n * H, m), dtype=acc, device=dev)
    mhc_read_bwd_x_kernel[(blocks, chunks)](
        x, g_xin, h_pre, dds, coef, phi, dx, dphi, T, H, per_chunk,
        N=n, M=m, NP=NP, P2=P2, VARIANT=VARIANT_IDS[variant], ACC=_tl(x.dtype),
        DOT_PREC=_dot_precision(x), BT=BT, BH=BH, num_warps=4)
    dphi = dphi.sum(0) if chunks > 1 else dphi[0]
    sums = part.sum(0)  # [alpha (2 or 3) | unused | bias | norm weight]
    gates = alpha.numel()
    dnorm = None
    if grads_as_views and sums.dtype == alpha.dtype == bias.dtype and (
            not norm or norm_weight.dtype == sums.dtype):
        views = sums.split([gates, 3 - gates, m] + ([H] if norm else []))
        dalpha, dbias = views[0], views[2]
        dnorm = views[3] if norm else None
    else:  # copies: a custom op's outputs may not be views of one another
        dalpha = sums[:gates].to(alpha.dtype, copy=True)
        dbias = sums[3:3 + m].to(bias.dtype, copy=True)
        if norm:
            dnorm = sums[3 + m:].to(norm_weight.dtype, copy=True)
    return dx, dphi.to(phi.dtype), dalpha, dbias, dnorm


def mhc_post_res_fwd(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor,
                     h_res: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [..., n, h]``, ``y [..., h]``, ``h_post [..., n]``, ``h_res [..., n, n]`` or None
    (contiguous, ``T`` tokens in the leading dims) -> ``[..., n, h]`` in x.dtype (fp32
    arithmetic)."""
    T, (n, H) = _rows(x), x.shape[-2:]
    out = torch.empty_like(x)
    BT, BH = _block_t(x), 64
    mhc_post_res_fwd_kernel[(cdiv(T, BT), cdiv(H, BH))](
        x, y, h_post, h_post if h_res is None else h_res, out, T, H,
        N=n, NP=next_power_of_2(n), HAS_RES=h_res is not None,
        ACC=_tl(h_post.dtype), BT=BT, BH=BH, num_warps=4)
    return out


def mhc_post_res_bwd(x, y, h_post, h_res, g):
    """``(dx, dy, dh_post, dh_res)``; ``dx`` is ``g`` itself when ``h_res`` is None."""
    T, (n, H) = _rows(x), x.shape[-2:]
    dx = g if h_res is None else torch.empty_like(x)
    dy = torch.empty_like(y)
    dh_post = torch.empty_like(h_post)
    dh_res = None if h_res is None else torch.empty_like(h_res)
    BT = _block_t(x)
    mhc_post_res_bwd_kernel[(cdiv(T, BT),)](
        x, y, h_post, h_post if h_res is None else h_res, g, dx, dy, dh_post,
        h_post if h_res is None else dh_res, T, H,
        N=n, NP=next_power_of_2(n), HAS_RES=h_res is not None,
        ACC=_tl(h_post.dtype), BT=BT, BH=64, num_warps=8)  # 4 warps spill on sm_90
    return dx, dy, dh_post, dh_res


__all__ = [
    "mhc_post_res_bwd",
    "mhc_post_res_fwd",
    "mhc_read_bwd",
    "mhc_read_fwd",
    "sinkhorn_bwd",
    "sinkhorn_fwd",
]
