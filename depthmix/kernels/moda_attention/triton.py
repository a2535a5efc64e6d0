"""Fused MoDA attention in Triton: kernels, then the host launchers ``moda_attention_fwd`` /
``moda_attention_bwd``.

One flash-style pass per query tile with ONE online softmax over the causal sequence keys
and the tile's own depth entries (MoDA paper, "Hardware-Efficient MoDA Implementation").

Tiling (per KV head ``n`` of sample ``b``; everything is TP-local, the rank's heads only):

* **Folded GQA rows.** The ``G`` query heads of a KV group share its sequence and depth
  K/V, so a tile's rows are ``tokens x GP`` (``GP`` = ``G`` rounded up to a power of two;
  padded rows are masked): row ``r`` is head ``r % GP`` of token ``t0 + r // GP``. Every
  K/V tile is loaded once for all ``G`` heads, and dK/dV are sums over the rows, so the
  backward accumulates them per KV head without atomics.
* **Chunk- and group-aware depth.** A tile of ``BLOCK_M`` rows covers ``BLOCK_M / GP``
  tokens and reads exactly those tokens' ``[D, hn]`` depth tiles (the ``[s, b, ng, D, hn]``
  layout keeps each one contiguous), each once: the depth KV costs one read in the
  forward, one read and one gradient write in the backward, the minimum.
* **Depth sub-tiles.** The paper computes the depth scores of a tile as one dense
  ``[C, C/G * D]`` product and masks it to its block diagonal, wasting a factor ``C/G``
  of the depth FLOPs. Here the tile is cut into sub-tiles of ``SUB`` rows (``SUB = 16``,
  the smallest tensor-core M, or ``GP`` if larger), each ``SUB / GP`` tokens, and the depth
  step is a batched product ``[NSUB, SUB, hn] x [NSUB, hn, SUB/GP * BLOCK_D]``: the waste
  is ``SUB / GP`` (2 at ``G = 8``, none at ``G >= 16``) whatever the tile size.
  ``depth_sub = block_m`` gives the paper's single block-diagonal product (2-D dots only).
* **Masks.** Sequence: key ``k`` is visible to a row of token ``t`` iff
  ``k <= sk - sq + t`` (the paper's ``floor(i_q / G) >= i_k``, with the decoding offset);
  blocks entirely below the tile's first position skip the mask. Depth: a row sees the
  entries of its own token (``floor(i_q / G) = floor(j_d / D)``) with index ``< count``;
  entries at or beyond ``count`` are never loaded.
* **Statistics.** Scores are scaled by ``scale * log2(e)`` and exponentiated with
  ``exp2``; the running max, sum and the saved log-sum-exp (base 2, one per row) are fp32.
  The backward recomputes the probabilities from ``lse`` and ``delta = rowsum(dO * O)``.

Backward: ``_moda_bwd_dkdv_kernel`` (one program per sequence key block: dK, dV over the
causal query tiles, all folded heads) and ``_moda_bwd_dq_kernel`` (one program per query
tile: dQ over its keys and its depth entries, and the depth gradients dK_d, dV_d of its
tokens, which no other program touches). Deterministic: no atomics anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from depthmix.kernels._common import (
    cdiv,
    host_cache,
    interpreting,
    last_dim_contiguous,
    next_power_of_2,
)

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _bdot(a, b, NSUB: tl.constexpr, PREC: tl.constexpr):
    """Batched ``[NSUB, M, K] x [NSUB, K, N]``; plain 2-D ``tl.dot`` when ``NSUB == 1``."""
    if NSUB == 1:
        a2 = tl.reshape(a, (a.shape[1], a.shape[2]))
        b2 = tl.reshape(b, (b.shape[1], b.shape[2]))
        out = tl.reshape(tl.dot(a2, b2, input_precision=PREC), (1, a.shape[1], b.shape[2]))
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def _depth_offsets(stride_ds, stride_dd, NSUB: tl.constexpr, SUB: tl.constexpr,
                   GP: tl.constexpr, BLOCK_D: tl.constexpr, HD_P: tl.constexpr):
    """Index helpers of the depth step. Column ``c`` of sub-tile ``s`` is entry
    ``c % BLOCK_D`` (plus the step's ``j0``) of token ``s * SUB/GP + c // BLOCK_D``
    (relative to the tile's first token)."""
    TS: tl.constexpr = SUB // GP
    N: tl.constexpr = TS * BLOCK_D
    sub = tl.arange(0, NSUB)
    col = tl.arange(0, N)
    h = tl.arange(0, HD_P)
    col_tok = sub[:, None] * TS + col[None, :] // BLOCK_D  # [NSUB, N]
    ent = col % BLOCK_D  # [N]
    # [NSUB, N, HD_P] offsets of (token, entry, h); the K side is loaded transposed
    off = (col_tok[:, :, None] * stride_ds + ent[None, :, None] * stride_dd
           + h[None, None, :])
    # a row (i in its sub-tile) sees a column iff both belong to the same token
    same = (tl.arange(0, SUB)[:, None] // GP) == (col[None, :] // BLOCK_D)  # [SUB, N]
    return col_tok, ent, off, same


@triton.jit
def _depth_fwd_steps(acc, m_i, l_i, q, kd_base, vd_base, t0, sq, count, stride_kds, stride_kdd,
                     stride_vds, stride_vdd, qk_scale, h_ok, BLOCK_M: tl.constexpr,
                     SUB: tl.constexpr, GP: tl.constexpr, BLOCK_D: tl.constexpr,
                     HD_P: tl.constexpr, PREC: tl.constexpr):
    """The online softmax of a tile's rows (``acc [BLOCK_M, HD_P]``, running max ``m_i`` and
    sum ``l_i``, base 2) carried over the ``count`` depth entries of each row's own token.
    ``kd_base`` / ``vd_base`` point at the tile's first token."""
    NSUB: tl.constexpr = BLOCK_M // SUB
    col_tok, ent, d_off, same = _depth_offsets(stride_kds, stride_kdd, NSUB, SUB, GP, BLOCK_D,
                                               HD_P)
    _, _, vd_off, _ = _depth_offsets(stride_vds, stride_vdd, NSUB, SUB, GP, BLOCK_D, HD_P)
    col_ok = (t0 + col_tok) < sq  # [NSUB, N]
    q3 = tl.reshape(q, (NSUB, SUB, HD_P))
    m3 = tl.reshape(m_i, (NSUB, SUB))
    l3 = tl.reshape(l_i, (NSUB, SUB))
    acc3 = tl.reshape(acc, (NSUB, SUB, HD_P))
    for j0 in range(0, count, BLOCK_D):
        ent_ok = (j0 + ent) < count  # [N]
        ld_ok = col_ok[:, :, None] & ent_ok[None, :, None] & h_ok[None, None, :]
        kd = tl.load(kd_base + j0 * stride_kdd + d_off, mask=ld_ok, other=0.0)
        s = _bdot(q3, tl.trans(kd, (0, 2, 1)), NSUB, PREC) * qk_scale  # [NSUB, SUB, N]
        s = tl.where(same[None, :, :] & ent_ok[None, None, :], s, float("-inf"))
        m_new = tl.maximum(m3, tl.max(s, 2))
        alpha = tl.math.exp2(m3 - m_new)
        p = tl.math.exp2(s - m_new[:, :, None])
        l3 = l3 * alpha + tl.sum(p, 2)
        vd = tl.load(vd_base + j0 * stride_vdd + vd_off, mask=ld_ok, other=0.0)
        acc3 = acc3 * alpha[:, :, None] + _bdot(p.to(vd.dtype), vd, NSUB, PREC)
        m3 = m_new
    return (tl.reshape(acc3, (BLOCK_M, HD_P)), tl.reshape(m3, (BLOCK_M,)),
            tl.reshape(l3, (BLOCK_M,)))


@triton.jit
def _depth_bwd_steps(q, do, lse, delta, KD, VD, DKD, DVD, kd_base, vd_base, t0, sq, count,
                     stride_kds, stride_kdd, stride_vds, stride_vdd, qk_scale, sm_scale, h_ok,
                     BLOCK_M: tl.constexpr, SUB: tl.constexpr, GP: tl.constexpr,
                     BLOCK_D: tl.constexpr, HD_P: tl.constexpr, PREC: tl.constexpr):
    """The depth part of a tile's backward: stores the gradients of its tokens' depth entries
    (``DKD``/``DVD`` share the strides of ``KD``/``VD``; ``kd_base``/``vd_base`` are the
    offsets of the tile's first token) and returns the rows' dQ contribution, unscaled
    (``sum_j dS_j K_j``). ``lse`` is base 2, ``delta = rowsum(dO * O)``."""
    NSUB: tl.constexpr = BLOCK_M // SUB
    col_tok, ent, d_off, same = _depth_offsets(stride_kds, stride_kdd, NSUB, SUB, GP, BLOCK_D,
                                               HD_P)
    _, _, vd_off, _ = _depth_offsets(stride_vds, stride_vdd, NSUB, SUB, GP, BLOCK_D, HD_P)
    col_ok = (t0 + col_tok) < sq
    q3 = tl.reshape(q, (NSUB, SUB, HD_P))
    do3 = tl.reshape(do, (NSUB, SUB, HD_P))
    lse3 = tl.reshape(lse, (NSUB, SUB))
    delta3 = tl.reshape(delta, (NSUB, SUB))
    dq3 = tl.zeros([NSUB, SUB, HD_P], tl.float32)
    for j0 in range(0, count, BLOCK_D):
        ent_ok = (j0 + ent) < count
        ld_ok = col_ok[:, :, None] & ent_ok[None, :, None] & h_ok[None, None, :]
        kd = tl.load(KD + kd_base + j0 * stride_kdd + d_off, mask=ld_ok, other=0.0)
        vd = tl.load(VD + vd_base + j0 * stride_vdd + vd_off, mask=ld_ok, other=0.0)
        s = _bdot(q3, tl.trans(kd, (0, 2, 1)), NSUB, PREC) * qk_scale  # [NSUB, SUB, N]
        p = tl.math.exp2(s - lse3[:, :, None])
        p = tl.where(same[None, :, :] & ent_ok[None, None, :], p, 0.0)
        dp = _bdot(do3, tl.trans(vd, (0, 2, 1)), NSUB, PREC)
        ds = p * (dp - delta3[:, :, None])
        dq3 += _bdot(ds.to(kd.dtype), kd, NSUB, PREC)
        # the tile owns these tokens' depth rows: plain stores, once each
        dvd = _bdot(tl.trans(p.to(do.dtype), (0, 2, 1)), do3, NSUB, PREC)  # [NSUB, N, HD_P]
        dkd = _bdot(tl.trans(ds.to(q.dtype), (0, 2, 1)), q3, NSUB, PREC) * sm_scale
        tl.store(DKD + kd_base + j0 * stride_kdd + d_off, dkd.to(DKD.dtype.element_ty),
                 mask=ld_ok)
        tl.store(DVD + vd_base + j0 * stride_vdd + vd_off, dvd.to(DVD.dtype.element_ty),
                 mask=ld_ok)
    return tl.reshape(dq3, (BLOCK_M, HD_P))


@triton.jit
def _moda_fwd_kernel(
    Q, K, V, KD, VD, O, LSE,
    stride_qs, stride_qb, stride_qh,
    stride_ks, stride_kb, stride_kh,
    stride_vs, stride_vb, stride_vh,
    stride_kds, stride_kdb, stride_kdh, stride_kdd,
    stride_vds, stride_vdb, stride_vdh, stride_vdd,
    stride_os, stride_ob, stride_oh,
    sq, sk, ng, count, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, HD_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_DEPTH: tl.constexpr, PREC: tl.constexpr,
):
    TOK_M: tl.constexpr = BLOCK_M // GP
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (last) tiles first
    pid_bn = tl.program_id(1)
    b = pid_bn // ng
    n = pid_bn % ng
    t0 = pid_m * TOK_M

    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GP
    head = rows % GP
    row_ok = (tok < sq) & (head < G)
    offs_h = tl.arange(0, HD_P)
    h_ok = offs_h < HEAD_DIM

    q_base = Q + tl.cast(b, tl.int64) * stride_qb + tl.cast(n * G, tl.int64) * stride_qh \
        + tl.cast(t0, tl.int64) * stride_qs
    q_off = (rows // GP)[:, None] * stride_qs + head[:, None] * stride_qh + offs_h[None, :]
    q = tl.load(q_base + q_off, mask=row_ok[:, None] & h_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked blocks give p = 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD_P], tl.float32)

    if HAS_DEPTH:  # the tile's own depth entries first (the softmax is order-free)
        kd_base = KD + tl.cast(b, tl.int64) * stride_kdb + tl.cast(n, tl.int64) * stride_kdh \
            + tl.cast(t0, tl.int64) * stride_kds
        vd_base = VD + tl.cast(b, tl.int64) * stride_vdb + tl.cast(n, tl.int64) * stride_vdh \
            + tl.cast(t0, tl.int64) * stride_vds
        acc, m_i, l_i = _depth_fwd_steps(acc, m_i, l_i, q, kd_base, vd_base, t0, sq, count,
                                         stride_kds, stride_kdd, stride_vds, stride_vdd,
                                         qk_scale, h_ok, BLOCK_M, SUB, GP, BLOCK_D, HD_P, PREC)

    # causal sequence keys: blocks every row sees in full, then the diagonal with the mask
    off_kv = sk - sq
    pos = off_kv + tok
    lo_full = ((off_kv + t0 + 1) // BLOCK_N) * BLOCK_N
    hi = off_kv + tl.minimum(t0 + TOK_M, sq)
    k_base = K + tl.cast(b, tl.int64) * stride_kb + tl.cast(n, tl.int64) * stride_kh
    v_base = V + tl.cast(b, tl.int64) * stride_vb + tl.cast(n, tl.int64) * stride_vh
    acc, m_i, l_i = _fwd_seq(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, 0, lo_full,
                             pos, sk, qk_scale, h_ok, HD_P, BLOCK_N, False, PREC)
    acc, m_i, l_i = _fwd_seq(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, lo_full, hi,
                             pos, sk, qk_scale, h_ok, HD_P, BLOCK_N, True, PREC)

    out = acc / l_i[:, None]
    o_base = O + tl.cast(b, tl.int64) * stride_ob + tl.cast(n * G, tl.int64) * stride_oh \
        + tl.cast(t0, tl.int64) * stride_os
    o_off = (rows // GP)[:, None] * stride_os + head[:, None] * stride_oh + offs_h[None, :]
    tl.store(o_base + o_off, out.to(O.dtype.element_ty), mask=row_ok[:, None] & h_ok[None, :])
    lse = tl.where(row_ok, m_i + tl.math.log2(l_i), float("inf"))  # padded heads: p = 0
    lse_base = LSE + tl.cast(pid_bn, tl.int64) * sq * GP
    tl.store(lse_base + tok * GP + head, lse, mask=tok < sq)


@triton.jit
def _fwd_seq(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, lo, hi, pos, sk, qk_scale,
             h_ok, HD_P: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
             PREC: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HD_P)
    for k0 in range(lo, hi, BLOCK_N):
        kn = k0 + offs_n
        k_ok = kn < sk
        kt = tl.load(k_base + tl.cast(k0, tl.int64) * stride_ks + offs_n[None, :] * stride_ks
                     + offs_h[:, None], mask=k_ok[None, :] & h_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASK:
            s = tl.where((kn[None, :] <= pos[:, None]) & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + tl.cast(k0, tl.int64) * stride_vs + offs_n[:, None] * stride_vs
                    + offs_h[None, :], mask=k_ok[:, None] & h_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _moda_bwd_preprocess(
    O, DO, DELTA,
    stride_os, stride_ob, stride_oh,
    stride_dos, stride_dob, stride_doh,
    sq, ng,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, HD_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``delta = rowsum(dO * O)`` in fp32, in the folded row order (padded heads: 0)."""
    TOK_M: tl.constexpr = BLOCK_M // GP
    pid_bn = tl.program_id(1)
    b = pid_bn // ng
    n = pid_bn % ng
    t0 = tl.program_id(0) * TOK_M
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GP
    head = rows % GP
    offs_h = tl.arange(0, HD_P)
    mask = ((tok < sq) & (head < G))[:, None] & (offs_h < HEAD_DIM)[None, :]
    rel = (rows // GP)[:, None]
    o = tl.load(O + tl.cast(b, tl.int64) * stride_ob + tl.cast(n * G, tl.int64) * stride_oh
                + tl.cast(t0, tl.int64) * stride_os + rel * stride_os + head[:, None] * stride_oh
                + offs_h[None, :], mask=mask, other=0.0)
    do = tl.load(DO + tl.cast(b, tl.int64) * stride_dob + tl.cast(n * G, tl.int64) * stride_doh
                 + tl.cast(t0, tl.int64) * stride_dos + rel * stride_dos + head[:, None] * stride_doh
                 + offs_h[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + tl.cast(pid_bn, tl.int64) * sq * GP + tok * GP + head, delta, mask=tok < sq)


@triton.jit
def _moda_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qs, stride_qb, stride_qh,
    stride_ks, stride_kb, stride_kh,
    stride_vs, stride_vb, stride_vh,
    stride_dos, stride_dob, stride_doh,
    stride_dks, stride_dkb, stride_dkh,
    stride_dvs, stride_dvb, stride_dvh,
    sq, sk, ng, qk_scale, sm_scale,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, HD_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """dK, dV of one block of ``BLOCK_N`` sequence keys, summed over every query row (all
    ``G`` heads of the group) that sees them."""
    TOK_M: tl.constexpr = BLOCK_M // GP
    pid_bn = tl.program_id(1)
    b = pid_bn // ng
    n = pid_bn % ng
    k0 = tl.program_id(0) * BLOCK_N
    offs_n = k0 + tl.arange(0, BLOCK_N)
    k_ok = offs_n < sk
    offs_h = tl.arange(0, HD_P)
    h_ok = offs_h < HEAD_DIM
    kv_mask = k_ok[:, None] & h_ok[None, :]
    k = tl.load(K + tl.cast(b, tl.int64) * stride_kb + tl.cast(n, tl.int64) * stride_kh
                + tl.cast(k0, tl.int64) * stride_ks + tl.arange(0, BLOCK_N)[:, None] * stride_ks
                + offs_h[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + tl.cast(b, tl.int64) * stride_vb + tl.cast(n, tl.int64) * stride_vh
                + tl.cast(k0, tl.int64) * stride_vs + tl.arange(0, BLOCK_N)[:, None] * stride_vs
                + offs_h[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, HD_P], tl.float32)
    dv = tl.zeros([BLOCK_N, HD_P], tl.float32)

    off_kv = sk - sq
    tq0 = tl.maximum(k0 - off_kv, 0)  # first token that sees key k0
    t_full = tl.maximum(tq0, k0 + BLOCK_N - 1 - off_kv)  # tokens >= t_full see the whole block
    n_tiles = tl.cdiv(sq, TOK_M)
    first = tq0 // TOK_M
    full = tl.minimum(tl.cdiv(t_full, TOK_M), n_tiles)
    q_base = Q + tl.cast(b, tl.int64) * stride_qb + tl.cast(n * G, tl.int64) * stride_qh
    do_base = DO + tl.cast(b, tl.int64) * stride_dob + tl.cast(n * G, tl.int64) * stride_doh
    row_base = tl.cast(pid_bn, tl.int64) * sq * GP
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                         stride_qs, stride_qh, stride_dos, stride_doh, first, full, offs_n,
                         off_kv, sq, qk_scale, h_ok, G, GP, HD_P, BLOCK_M, True, PREC)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                         stride_qs, stride_qh, stride_dos, stride_doh, full, n_tiles, offs_n,
                         off_kv, sq, qk_scale, h_ok, G, GP, HD_P, BLOCK_M, False, PREC)
    dk = dk * sm_scale
    tl.store(DK + tl.cast(b, tl.int64) * stride_dkb + tl.cast(n, tl.int64) * stride_dkh
             + tl.cast(k0, tl.int64) * stride_dks + tl.arange(0, BLOCK_N)[:, None] * stride_dks
             + offs_h[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + tl.cast(b, tl.int64) * stride_dvb + tl.cast(n, tl.int64) * stride_dvh
             + tl.cast(k0, tl.int64) * stride_dvs + tl.arange(0, BLOCK_N)[:, None] * stride_dvs
             + offs_h[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, stride_qs, stride_qh,
                stride_dos, stride_doh, tile_lo, tile_hi, offs_n, off_kv, sq, qk_scale, h_ok,
                G: tl.constexpr, GP: tl.constexpr, HD_P: tl.constexpr, BLOCK_M: tl.constexpr,
                MASK: tl.constexpr, PREC: tl.constexpr):
    TOK_M: tl.constexpr = BLOCK_M // GP
    rows = tl.arange(0, BLOCK_M)
    rel = rows // GP
    head = rows % GP
    offs_h = tl.arange(0, HD_P)
    for tile in range(tile_lo, tile_hi):
        t0 = tile * TOK_M
        tok = t0 + rel
        ld = ((tok < sq) & (head < G))[:, None] & h_ok[None, :]
        q = tl.load(q_base + tl.cast(t0, tl.int64) * stride_qs + rel[:, None] * stride_qs
                    + head[:, None] * stride_qh + offs_h[None, :], mask=ld, other=0.0)
        do = tl.load(do_base + tl.cast(t0, tl.int64) * stride_dos + rel[:, None] * stride_dos
                     + head[:, None] * stride_doh + offs_h[None, :], mask=ld, other=0.0)
        lse = tl.load(lse_ptr + tok * GP + head, mask=tok < sq, other=float("inf"))
        delta = tl.load(delta_ptr + tok * GP + head, mask=tok < sq, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # [BLOCK_N, BLOCK_M]
        pt = tl.math.exp2(st - lse[None, :])
        if MASK:
            pt = tl.where(offs_n[:, None] <= (off_kv + tok)[None, :], pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _moda_bwd_dq_kernel(
    Q, K, V, KD, VD, DO, LSE, DELTA, DQ, DKD, DVD,
    stride_qs, stride_qb, stride_qh,
    stride_ks, stride_kb, stride_kh,
    stride_vs, stride_vb, stride_vh,
    stride_kds, stride_kdb, stride_kdh, stride_kdd,
    stride_vds, stride_vdb, stride_vdh, stride_vdd,
    stride_dos, stride_dob, stride_doh,
    stride_dqs, stride_dqb, stride_dqh,
    sq, sk, ng, count, qk_scale, sm_scale,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, HD_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_DEPTH: tl.constexpr, PREC: tl.constexpr,
):
    """dQ of one query tile (sequence keys and depth entries), and the depth gradients of
    the tile's tokens (``DKD``/``DVD`` share the strides of ``KD``/``VD``)."""
    TOK_M: tl.constexpr = BLOCK_M // GP
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bn = tl.program_id(1)
    b = pid_bn // ng
    n = pid_bn % ng
    t0 = pid_m * TOK_M

    rows = tl.arange(0, BLOCK_M)
    rel = rows // GP
    tok = t0 + rel
    head = rows % GP
    offs_h = tl.arange(0, HD_P)
    h_ok = offs_h < HEAD_DIM
    ld = ((tok < sq) & (head < G))[:, None] & h_ok[None, :]
    q = tl.load(Q + tl.cast(b, tl.int64) * stride_qb + tl.cast(n * G, tl.int64) * stride_qh
                + tl.cast(t0, tl.int64) * stride_qs + rel[:, None] * stride_qs
                + head[:, None] * stride_qh + offs_h[None, :], mask=ld, other=0.0)
    do = tl.load(DO + tl.cast(b, tl.int64) * stride_dob + tl.cast(n * G, tl.int64) * stride_doh
                 + tl.cast(t0, tl.int64) * stride_dos + rel[:, None] * stride_dos
                 + head[:, None] * stride_doh + offs_h[None, :], mask=ld, other=0.0)
    row_base = tl.cast(pid_bn, tl.int64) * sq * GP
    lse = tl.load(LSE + row_base + tok * GP + head, mask=tok < sq, other=float("inf"))
    delta = tl.load(DELTA + row_base + tok * GP + head, mask=tok < sq, other=0.0)
    dq = tl.zeros([BLOCK_M, HD_P], tl.float32)

    off_kv = sk - sq
    pos = off_kv + tok
    lo_full = ((off_kv + t0 + 1) // BLOCK_N) * BLOCK_N
    hi = off_kv + tl.minimum(t0 + TOK_M, sq)
    k_base = K + tl.cast(b, tl.int64) * stride_kb + tl.cast(n, tl.int64) * stride_kh
    v_base = V + tl.cast(b, tl.int64) * stride_vb + tl.cast(n, tl.int64) * stride_vh
    dq = _dq_seq(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, 0, lo_full, pos,
                 sk, qk_scale, h_ok, HD_P, BLOCK_N, False, PREC)
    dq = _dq_seq(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, lo_full, hi, pos,
                 sk, qk_scale, h_ok, HD_P, BLOCK_N, True, PREC)

    if HAS_DEPTH:
        kd_base = tl.cast(b, tl.int64) * stride_kdb + tl.cast(n, tl.int64) * stride_kdh \
            + tl.cast(t0, tl.int64) * stride_kds
        vd_base = tl.cast(b, tl.int64) * stride_vdb + tl.cast(n, tl.int64) * stride_vdh \
            + tl.cast(t0, tl.int64) * stride_vds
        dq += _depth_bwd_steps(q, do, lse, delta, KD, VD, DKD, DVD, kd_base, vd_base, t0, sq,
                               count, stride_kds, stride_kdd, stride_vds, stride_vdd, qk_scale,
                               sm_scale, h_ok, BLOCK_M, SUB, GP, BLOCK_D, HD_P, PREC)

    dq = dq * sm_scale
    tl.store(DQ + tl.cast(b, tl.int64) * stride_dqb + tl.cast(n * G, tl.int64) * stride_dqh
             + tl.cast(t0, tl.int64) * stride_dqs + rel[:, None] * stride_dqs
             + head[:, None] * stride_dqh + offs_h[None, :], dq.to(DQ.dtype.element_ty), mask=ld)


@triton.jit
def _dq_seq(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, lo, hi, pos, sk,
            qk_scale, h_ok, HD_P: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
            PREC: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HD_P)
    for k0 in range(lo, hi, BLOCK_N):
        kn = k0 + offs_n
        k_ok = kn < sk
        kt = tl.load(k_base + tl.cast(k0, tl.int64) * stride_ks + offs_n[None, :] * stride_ks
                     + offs_h[:, None], mask=k_ok[None, :] & h_ok[:, None], other=0.0)
        vt = tl.load(v_base + tl.cast(k0, tl.int64) * stride_vs + offs_n[None, :] * stride_vs
                     + offs_h[:, None], mask=k_ok[None, :] & h_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASK:
            p = tl.where((kn[None, :] <= pos[:, None]) & k_ok[None, :], p, 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PREC)
    return dq


@triton.jit
def _moda_depth_fwd_kernel(
    Q, KD, VD, OS, LSES, O, LSE,
    stride_qs, stride_qb, stride_qh,
    stride_kds, stride_kdb, stride_kdh, stride_kdd,
    stride_vds, stride_vdb, stride_vdh, stride_vdd,
    stride_oss, stride_osb, stride_osh,
    stride_ls, stride_lb, stride_lh,
    stride_os, stride_ob, stride_oh,
    sq, ng, count, qk_scale,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, HD_P: tl.constexpr,
    BLOCK_M: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    """The split path's depth part, merged into the sequence part: one tile of folded rows
    starts its online softmax from the sequence attention's normalised output ``OS`` and
    natural log-sum-exp ``LSES`` (max = lse, sum = 1, accumulator = output), runs it over
    the rows' own depth entries and stores the joint output ``O`` and log-sum-exp ``LSE``
    (natural, ``LSES``'s strides). The merge of two blocks as ring attention merges them."""
    TOK_M: tl.constexpr = BLOCK_M // GP
    pid_bn = tl.program_id(1)
    b = pid_bn // ng
    n = pid_bn % ng
    t0 = tl.program_id(0) * TOK_M

    rows = tl.arange(0, BLOCK_M)
    rel = rows // GP
    tok = t0 + rel
    head = rows % GP
    row_ok = (tok < sq) & (head < G)
    offs_h = tl.arange(0, HD_P)
    h_ok = offs_h < HEAD_DIM
    ld = row_ok[:, None] & h_ok[None, :]
    b64, hq, t64 = tl.cast(b, tl.int64), tl.cast(n * G, tl.int64), tl.cast(t0, tl.int64)
    q = tl.load(Q + b64 * stride_qb + hq * stride_qh + t64 * stride_qs
                + rel[:, None] * stride_qs + head[:, None] * stride_qh + offs_h[None, :],
                mask=ld, other=0.0)
    acc = tl.load(OS + b64 * stride_osb + hq * stride_osh + t64 * stride_oss
                  + rel[:, None] * stride_oss + head[:, None] * stride_osh + offs_h[None, :],
                  mask=ld, other=0.0).to(tl.float32)
    lse_off = b64 * stride_lb + hq * stride_lh + t64 * stride_ls + rel * stride_ls \
        + head * stride_lh
    m_i = tl.load(LSES + lse_off, mask=row_ok, other=0.0) * 1.4426950408889634  # base 2
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)

    kd_base = KD + b64 * stride_kdb + tl.cast(n, tl.int64) * stride_kdh + t64 * stride_kds
    vd_base = VD + b64 * stride_vdb + tl.cast(n, tl.int64) * stride_vdh + t64 * stride_vds
    acc, m_i, l_i = _depth_fwd_steps(acc, m_i, l_i, q, kd_base, vd_base, t0, sq, count,
                                     stride_kds, stride_kdd, stride_vds, stride_vdd, qk_scale,
                                     h_ok, BLOCK_M, SUB, GP, BLOCK_D, HD_P, PREC)

    out = acc / l_i[:, None]
    tl.store(O + b64 * stride_ob + hq * stride_oh + t64 * stride_os + rel[:, None] * stride_os
             + head[:, None] * stride_oh + offs_h[None, :], out.to(O.dtype.element_ty), mask=ld)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log again
    tl.store(LSE + lse_off, lse, mask=row_ok)


@triton.jit
def _moda_depth_bwd_kernel(
    Q, KD, VD, O, DO, LSE, DQS, DQ, DKD, DVD,
    stride_qs, stride_qb, stride_qh,
    stride_kds, stride_kdb, stride_kdh, stride_kdd,
    stride_vds, stride_vdb, stride_vdh, stride_vdd,
    stride_os, stride_ob, stride_oh,
    stride_dos, stride_dob, stride_doh,
    stride_ls, stride_lb, stride_lh,
    stride_dqss, stride_dqsb, stride_dqsh,
    stride_dqs, stride_dqb, stride_dqh,
    sq, ng, count, qk_scale, sm_scale,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, HD_P: tl.constexpr,
    BLOCK_M: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    """The split path's depth backward for one tile: with the joint output ``O`` and
    log-sum-exp ``LSE`` (natural), the probabilities of the rows' depth entries and
    ``delta = rowsum(dO * O)`` are the joint softmax's, so this stores ``dQ = DQS`` (the
    sequence part's gradient, which the attention backward computed with the same ``O``
    and ``LSE``) plus the depth part's, and the tile's depth gradients ``DKD``/``DVD``
    (strides of ``KD``/``VD``)."""
    TOK_M: tl.constexpr = BLOCK_M // GP
    pid_bn = tl.program_id(1)
    b = pid_bn // ng
    n = pid_bn % ng
    t0 = tl.program_id(0) * TOK_M

    rows = tl.arange(0, BLOCK_M)
    rel = rows // GP
    tok = t0 + rel
    head = rows % GP
    row_ok = (tok < sq) & (head < G)
    offs_h = tl.arange(0, HD_P)
    h_ok = offs_h < HEAD_DIM
    ld = row_ok[:, None] & h_ok[None, :]
    b64, hq, t64 = tl.cast(b, tl.int64), tl.cast(n * G, tl.int64), tl.cast(t0, tl.int64)
    q = tl.load(Q + b64 * stride_qb + hq * stride_qh + t64 * stride_qs
                + rel[:, None] * stride_qs + head[:, None] * stride_qh + offs_h[None, :],
                mask=ld, other=0.0)
    do = tl.load(DO + b64 * stride_dob + hq * stride_doh + t64 * stride_dos
                 + rel[:, None] * stride_dos + head[:, None] * stride_doh + offs_h[None, :],
                 mask=ld, other=0.0)
    o = tl.load(O + b64 * stride_ob + hq * stride_oh + t64 * stride_os
                + rel[:, None] * stride_os + head[:, None] * stride_oh + offs_h[None, :],
                mask=ld, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse_off = b64 * stride_lb + hq * stride_lh + t64 * stride_ls + rel * stride_ls \
        + head * stride_lh
    lse = tl.load(LSE + lse_off, mask=row_ok, other=float("inf")) * 1.4426950408889634

    kd_base = b64 * stride_kdb + tl.cast(n, tl.int64) * stride_kdh + t64 * stride_kds
    vd_base = b64 * stride_vdb + tl.cast(n, tl.int64) * stride_vdh + t64 * stride_vds
    dq = _depth_bwd_steps(q, do, lse, delta, KD, VD, DKD, DVD, kd_base, vd_base, t0, sq, count,
                          stride_kds, stride_kdd, stride_vds, stride_vdd, qk_scale, sm_scale,
                          h_ok, BLOCK_M, SUB, GP, BLOCK_D, HD_P, PREC)
    dq_seq = tl.load(DQS + b64 * stride_dqsb + hq * stride_dqsh + t64 * stride_dqss
                     + rel[:, None] * stride_dqss + head[:, None] * stride_dqsh
                     + offs_h[None, :], mask=ld, other=0.0)
    dq = dq_seq.to(tl.float32) + dq * sm_scale
    tl.store(DQ + b64 * stride_dqb + hq * stride_dqh + t64 * stride_dqs
             + rel[:, None] * stride_dqs + head[:, None] * stride_dqh + offs_h[None, :],
             dq.to(DQ.dtype.element_ty), mask=ld)


# ---------------------------------------------------------------------------------------
# Tiles
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    """Tile sizes. Query tiles are counted in folded rows (tokens x GP)."""

    block_m: int = 128
    """Forward and dQ kernel: query rows per program."""
    block_n: int = 64
    """Forward and dQ kernel: sequence keys per step."""
    depth_sub: int = 16
    """Query rows per depth sub-tile (``block_m``: one 2-D block-diagonal product)."""
    block_d: int = 8
    """Depth entries per token per depth step."""
    dkdv_m: int = 64
    """dK/dV kernel: query rows per step."""
    dkdv_n: int = 64
    """dK/dV kernel: sequence keys per program."""
    num_warps: int = 8
    num_stages: int = 2


@host_cache
def default_tiles(head_dim: int, group: int, depth: int, sub_tiles: bool = True) -> Tiles:
    """Tiles for a head dim, group size ``G`` and depth capacity ``D``.

    GPU: query tiles of 128 rows with 32-key steps (head dims <= 64), 64 x 64 (128),
    64 x 32 (256); the dK/dV kernel 32 query rows per step over 64 keys (32 x 32 at 256).
    These are the largest tiles of this shape family with which no kernel spills registers
    on sm_80 or sm_90 at the benchmark shapes (``tools/kernel_report.py``; 128 x 64 spilled
    up to 1.2 KB in the dQ kernel at head dim 128); not yet timed on a GPU. Depth sub-tiles
    of 16 rows (``sub_tiles=False``: the paper's one block-diagonal product per tile), and
    depth steps of ``block_d`` entries such that a step loads about as many depth rows as a
    sequence step loads keys (at least 16 columns per sub-tile, the tensor-core minimum).
    The interpreter (CPU tests) uses 16-row tiles.
    """
    gp = next_power_of_2(group)
    hd = max(16, next_power_of_2(head_dim))
    if interpreting():
        block_m, block_n, dkdv_m, dkdv_n, warps, stages = 16, 16, 16, 16, 4, 1
    elif hd <= 64:
        block_m, block_n, dkdv_m, dkdv_n, warps, stages = 128, 32, 32, 64, 8, 2
    elif hd <= 128:
        block_m, block_n, dkdv_m, dkdv_n, warps, stages = 64, 64, 32, 64, 8, 2
    else:
        block_m, block_n, dkdv_m, dkdv_n, warps, stages = 64, 32, 32, 32, 4, 1
    block_m, dkdv_m = max(block_m, gp), max(dkdv_m, gp)
    sub = max(16, gp) if sub_tiles else block_m
    tokens_per_sub = sub // gp
    d_p2 = next_power_of_2(max(depth, 1))
    block_d = min(d_p2, max(1, block_n // (block_m // gp)))  # ~block_n depth rows per step
    block_d = max(block_d, 16 // tokens_per_sub if tokens_per_sub < 16 else 1)
    return Tiles(block_m, block_n, sub, block_d, dkdv_m, dkdv_n, warps, stages)


@host_cache
def _check_tiles(t: Tiles, gp: int) -> None:
    p2 = lambda x: x >= 1 and x & (x - 1) == 0  # noqa: E731
    for name in ("block_m", "block_n", "depth_sub", "block_d", "dkdv_m", "dkdv_n"):
        if not p2(getattr(t, name)):
            raise ValueError(f"tiles.{name}={getattr(t, name)} must be a power of two")
    if t.block_m % t.depth_sub or t.depth_sub % gp or t.dkdv_m % gp:
        raise ValueError(f"tiles {t} must satisfy GP={gp} | depth_sub | block_m and GP | dkdv_m")
    if min(t.block_m, t.block_n, t.dkdv_m, t.dkdv_n, t.depth_sub) < 16:
        raise ValueError(f"tiles {t}: dot operands need every tile side >= 16")
    if (t.depth_sub // gp) * t.block_d < 16:
        raise ValueError(f"tiles {t}: a depth sub-tile needs >= 16 columns "
                         "(depth_sub / GP * block_d)")


@dataclass(frozen=True)
class DepthTiles:
    """Tile sizes of the split path's depth kernels (rows folded as tokens x GP)."""

    block_m: int = 64
    """Query rows per program."""
    depth_sub: int = 16
    """Query rows per depth sub-tile."""
    block_d: int = 4
    """Depth entries per token per step."""
    num_warps: int = 4
    num_stages: int = 2


@host_cache
def default_depth_tiles(head_dim: int, group: int, depth: int) -> DepthTiles:
    """Depth-kernel tiles for a head dim, group size ``G`` and depth capacity ``D``.

    The kernels are memory-bound (each depth entry is read once and used by the ``G`` rows
    of its token: ``G`` multiply-adds per loaded element), so the tiles aim at wide loads
    and enough programs, not at tensor-core shapes: 64 folded rows a program (32 at head
    dims above 128), sub-tiles of 16 rows (``GP`` if larger), and depth steps loading 16
    columns a sub-tile (``16 / (SUB / GP)`` entries of each token; fewer if ``D`` is
    smaller, never under the 16-column minimum). The interpreter (CPU tests) uses 16-row
    tiles.
    """
    gp = next_power_of_2(group)
    hd = max(16, next_power_of_2(head_dim))
    if interpreting():
        block_m, warps, stages = 16, 4, 1
    elif hd <= 128:
        block_m, warps, stages = 64, 4 if hd <= 64 else 8, 2
    else:
        block_m, warps, stages = 32, 8, 2
    sub = max(16, gp)
    block_m = max(block_m, sub)
    tokens_per_sub = sub // gp
    block_d = max(1, 16 // tokens_per_sub)  # a 16-column step
    return DepthTiles(block_m, sub, block_d, warps, stages)


@host_cache
def _check_depth_tiles(t: DepthTiles, gp: int) -> None:
    p2 = lambda x: x >= 1 and x & (x - 1) == 0  # noqa: E731
    for name in ("block_m", "depth_sub", "block_d"):
        if not p2(getattr(t, name)):
            raise ValueError(f"depth tiles.{name}={getattr(t, name)} must be a power of two")
    if t.block_m % t.depth_sub or t.depth_sub % gp or t.depth_sub < 16:
        raise ValueError(f"depth tiles {t} must satisfy 16 <= depth_sub, GP={gp} | depth_sub "
                         "| block_m")
    if (t.depth_sub // gp) * t.block_d < 16:
        raise ValueError(f"depth tiles {t}: a depth sub-tile needs >= 16 columns "
                         "(depth_sub / GP * block_d)")


# ---------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------


@host_cache
def _precision(dtype: torch.dtype) -> str:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"moda_attention (Triton) takes fp32, bf16 or fp16 inputs, not {dtype}")
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs: exact fp32 products


def moda_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kd: Optional[torch.Tensor], vd: Optional[torch.Tensor], count: int,
                       scale: float, tiles: Tiles) -> Tuple[torch.Tensor, torch.Tensor]:
    """``q [sq, b, np, hn]``, ``k/v [sk, b, ng, hn]``, ``kd/vd [sq, b, ng, D, hn]`` (or
    None), ``count`` valid depth entries. Returns ``o [sq, b, np, hn]`` and the base-2
    log-sum-exp ``[b * ng, sq * GP]`` (fp32)."""
    sq, b, np_, hn = q.shape
    sk, _, ng, _ = k.shape
    g = np_ // ng
    gp = next_power_of_2(g)
    _check_tiles(tiles, gp)
    has_depth = kd is not None and count > 0
    kd_, vd_ = (kd, vd) if has_depth else (q.new_empty(1, 1, 1, 1, 1),) * 2
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(b * ng, sq * gp, device=q.device, dtype=torch.float32)
    grid = (cdiv(sq, tiles.block_m // gp), b * ng)
    _moda_fwd_kernel[grid](
        q, k, v, kd_, vd_, o, lse,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *kd_.stride()[:4],
        *vd_.stride()[:4],
        *o.stride()[:3],
        sq, sk, ng, count if has_depth else 0, scale * LOG2E,
        G=g, GP=gp, HEAD_DIM=hn, HD_P=max(16, next_power_of_2(hn)),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, SUB=tiles.depth_sub,
        BLOCK_D=tiles.block_d, HAS_DEPTH=has_depth, PREC=_precision(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return o, lse


def moda_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kd: Optional[torch.Tensor], vd: Optional[torch.Tensor], o: torch.Tensor,
                       lse: torch.Tensor, count: int, scale: float, tiles: Tiles):
    """Gradients ``dq, dk, dv, dkd, dvd`` (``dkd``/``dvd`` None without depth; entries at or
    beyond ``count`` get zero gradient)."""
    sq, b, np_, hn = q.shape
    sk, _, ng, _ = k.shape
    g = np_ // ng
    gp = next_power_of_2(g)
    hd_p = max(16, next_power_of_2(hn))
    has_depth = kd is not None and count > 0
    do = do.view(q.shape) if do.is_contiguous() else do.reshape(q.shape)
    (do,) = last_dim_contiguous(do)

    delta = torch.empty_like(lse)
    pre_m = max(16, gp)
    _moda_bwd_preprocess[(cdiv(sq, pre_m // gp), b * ng)](
        o, do, delta,
        *o.stride()[:3],
        *do.stride()[:3],
        sq, ng, G=g, GP=gp, HEAD_DIM=hn, HD_P=hd_p, BLOCK_M=pre_m,
    )

    prec = _precision(q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    _moda_bwd_dkdv_kernel[(cdiv(sk, tiles.dkdv_n), b * ng)](
        q, k, v, do, lse, delta, dk, dv,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *do.stride()[:3],
        *dk.stride()[:3],
        *dv.stride()[:3],
        sq, sk, ng, scale * LOG2E, scale,
        G=g, GP=gp, HEAD_DIM=hn, HD_P=hd_p, BLOCK_M=tiles.dkdv_m, BLOCK_N=tiles.dkdv_n,
        PREC=prec, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )

    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if has_depth:
        dkd = torch.empty(kd.shape, device=kd.device, dtype=kd.dtype)
        dvd = torch.empty(vd.shape, device=vd.device, dtype=vd.dtype)
        if count < kd.shape[3]:  # never read, zero gradient
            dkd[:, :, :, count:].zero_()
            dvd[:, :, :, count:].zero_()
        kd_, vd_, dkd_, dvd_ = kd, vd, dkd, dvd
    else:
        dkd = dvd = None
        kd_ = vd_ = dkd_ = dvd_ = q.new_empty(1, 1, 1, 1, 1)
    if dkd_.stride() != kd_.stride() or dvd_.stride() != vd_.stride():
        raise AssertionError("depth gradients must share the depth inputs' strides")
    _moda_bwd_dq_kernel[(cdiv(sq, tiles.block_m // gp), b * ng)](
        q, k, v, kd_, vd_, do, lse, delta, dq, dkd_, dvd_,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *kd_.stride()[:4],
        *vd_.stride()[:4],
        *do.stride()[:3],
        *dq.stride()[:3],
        sq, sk, ng, count if has_depth else 0, scale * LOG2E, scale,
        G=g, GP=gp, HEAD_DIM=hn, HD_P=hd_p, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        SUB=tiles.depth_sub, BLOCK_D=tiles.block_d, HAS_DEPTH=has_depth, PREC=prec,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return dq, dk, dv, dkd, dvd


def _bhs_strides(t: torch.Tensor) -> Tuple[int, int, int]:
    """``(seq, batch, head)`` strides of an attention op's ``[b, h, s, ...]`` tensor."""
    stride = t.stride()
    return stride[2], stride[0], stride[1]


def moda_depth_fwd(q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, o_seq: torch.Tensor,
                   lse_seq: torch.Tensor, count: int, scale: float, tiles: DepthTiles,
                   lse_out: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The split path's depth part and merge. ``q [sq, b, np, hn]``, ``kd/vd [sq, b, ng, D,
    hn]`` with ``count >= 1`` valid entries, and the causal sequence attention's output
    ``o_seq [b, np, sq, hn]`` and natural log-sum-exp ``lse_seq [b, np, sq]`` (or ``[..., 1]``;
    any strides) as an SDPA op returns them. Returns the joint output ``[sq, b, np, hn]``
    (contiguous) and log-sum-exp (fp32, ``lse_seq``'s strides): written into ``lse_out``
    where given, which may be ``lse_seq`` itself (each row is read before it is written),
    else into ``torch.empty_like(lse_seq)``."""
    sq, b, np_, hn = q.shape
    ng = kd.shape[2]
    g = np_ // ng
    gp = next_power_of_2(g)
    _check_depth_tiles(tiles, gp)
    o_seq, = last_dim_contiguous(o_seq)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty_like(lse_seq) if lse_out is None else lse_out
    if lse.stride() != lse_seq.stride():
        raise AssertionError("the joint log-sum-exp must share the sequence part's strides")
    grid = (cdiv(sq, tiles.block_m // gp), b * ng)
    _moda_depth_fwd_kernel[grid](
        q, kd, vd, o_seq, lse_seq, o, lse,
        *q.stride()[:3],
        *kd.stride()[:4],
        *vd.stride()[:4],
        *_bhs_strides(o_seq), *_bhs_strides(lse_seq),
        *o.stride()[:3],
        sq, ng, count, scale * LOG2E,
        G=g, GP=gp, HEAD_DIM=hn, HD_P=max(16, next_power_of_2(hn)),
        BLOCK_M=tiles.block_m, SUB=tiles.depth_sub, BLOCK_D=tiles.block_d,
        PREC=_precision(q.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return o, lse


def moda_depth_bwd(do: torch.Tensor, q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor,
                   o: torch.Tensor, lse: torch.Tensor, dq_seq: torch.Tensor, count: int,
                   scale: float, tiles: DepthTiles
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split path's depth backward: ``do``, ``q``, ``o`` ``[sq, b, np, hn]``, the joint
    log-sum-exp ``lse`` (as :func:`moda_depth_fwd` returned it) and the sequence part's
    query gradient ``dq_seq [b, np, sq, hn]`` (any strides). Returns ``dq`` (contiguous,
    ``dq_seq`` plus the depth part's), ``dkd``, ``dvd`` (entries at or beyond ``count``:
    zero)."""
    sq, b, np_, hn = q.shape
    ng = kd.shape[2]
    g = np_ // ng
    gp = next_power_of_2(g)
    _check_depth_tiles(tiles, gp)
    do, dq_seq = last_dim_contiguous(do, dq_seq)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dkd = torch.empty_like(kd)
    dvd = torch.empty_like(vd)
    if dkd.stride() != kd.stride() or dvd.stride() != vd.stride():
        raise AssertionError("depth gradients must share the depth inputs' strides")
    if count < kd.shape[3]:  # never read, zero gradient
        dkd[:, :, :, count:].zero_()
        dvd[:, :, :, count:].zero_()
    grid = (cdiv(sq, tiles.block_m // gp), b * ng)
    _moda_depth_bwd_kernel[grid](
        q, kd, vd, o, do, lse, dq_seq, dq, dkd, dvd,
        *q.stride()[:3],
        *kd.stride()[:4],
        *vd.stride()[:4],
        *o.stride()[:3],
        *do.stride()[:3],
        *_bhs_strides(lse), *_bhs_strides(dq_seq),
        *dq.stride()[:3],
        sq, ng, count, scale * LOG2E, scale,
        G=g, GP=gp, HEAD_DIM=hn, HD_P=max(16, next_power_of_2(hn)),
        BLOCK_M=tiles.block_m, SUB=tiles.depth_sub, BLOCK_D=tiles.block_d,
        PREC=_precision(q.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return dq, dkd, dvd


__all__ = ["DepthTiles", "Tiles", "default_depth_tiles", "default_tiles", "moda_attention_bwd",
           "moda_attention_fwd", "moda_depth_bwd", "moda_depth_fwd"]
