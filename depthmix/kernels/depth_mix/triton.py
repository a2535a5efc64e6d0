"""Fused Triton kernels for Depth-Attention's depth step (Depth-Attention paper, eqs. 2-3).

One program handles ``BLOCK_T`` token rows (``s`` and ``b`` flattened) of one KV head:

    q̄    = (1/G) Σ_g q[t, h·G + g]                       (GQA group mean, in registers)
    z_j  = q̄ · k_j / sqrt(hn),  j ∈ S(l) ∪ {l}           (fp32)
    a    = softmax(z)   (or 1/(S+1) for mix_rule=uniform)
    ṽ    = a_l v_l + Σ_j a_j ṽ_j,   k̃ = a_l k_l + Σ_j a_j k_j   (per mixed_state)

Sources are a tuple of tensors, so each has its own base pointer (list entries, views of a
stacked depth buffer, or views into the packed pipeline tensor) and nothing is
concatenated; they share one set of ``(s, b, head)`` strides. The forward is one pass over
the sources with an online softmax and writes the log-sum-exp ``[s, b, ng]`` (fp32) for the
backward, which recomputes the weights from it: pass 1 loads ``k_j, ṽ_j`` to get ``a_j``,
``da_j = dṽ·ṽ_j (+ dk̃·k_j)`` and ``Δ = Σ a_j da_j`` (kept as ``[BLOCK_T, S]`` register
tiles), pass 2 re-reads ``k_j`` (hot in L2) for ``dq̄ = scale Σ a_j (da_j - Δ) k_j`` and
``dk_j``. Every gradient is a plain store (no atomics), so the kernels can be autotuned.

Layout: ``depth_mix_fwd_kernel``, ``depth_mix_bwd_kernel``, then the host launchers
``depth_mix_fwd`` / ``depth_mix_bwd``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from depthmix.kernels._common import (
    acc_dtype,
    cdiv,
    interpreting,
    last_dim_contiguous,
    next_power_of_2,
    tl_dtype,
)

MAX_HEAD_DIM = 256


CUDA_CONFIGS = [triton.Config({"BLOCK_T": bt}, num_warps=w)
                for bt in (8, 16, 32, 64) for w in (2, 4, 8)]
"""What the autotuner tries on a GPU, before :func:`_prune_fwd` / :func:`_prune_bwd`
(``tools/kernel_report.py`` compiles each config they keep for sm_80 and sm_90)."""
INTERPRETER_CONFIGS = [triton.Config({"BLOCK_T": 64}, num_warps=4)]
"""The interpreter runs programs one by one in numpy: few, large tiles."""


def _configs():
    if interpreting() or not torch.cuda.is_available():
        return INTERPRETER_CONFIGS
    return CUDA_CONFIGS


def _kept(configs, block_d: int, per_thread: int):
    """The configs whose ``[BLOCK_T, BLOCK_D]`` tile holds at most ``per_thread`` elements
    per thread and 4096 in all (64 x 128 spilled in the backward at 8 warps on sm_90)."""
    kept = [c for c in configs
            if c.kwargs["BLOCK_T"] * block_d <= min(4096, per_thread * 32 * c.num_warps)]
    return kept or configs[:1]


def _arg(name: str, named_args, kwargs):
    return kwargs.get(name, named_args.get(name))


# Element budgets from ptxas for sm_80 and sm_90 (tools/kernel_report.py): at 64 per thread
# the backward spills 0.4-2 KB (255 registers), and so does the forward mixing keys and
# values; mixing both, the backward keeps about twice the tiles live: at 16 per thread
# ptxas holds sm_80 to 128 registers and spills, at 32 it needs 253 of 255.
def _prune_fwd(configs, named_args, **kwargs):
    return _kept(configs, _arg("BLOCK_D", named_args, kwargs), per_thread=32)


def _prune_bwd(configs, named_args, **kwargs):
    both = _arg("MIX_KEYS", named_args, kwargs) and _arg("MIX_VALUES", named_args, kwargs)
    return _kept(configs, _arg("BLOCK_D", named_args, kwargs), per_thread=8 if both else 32)


_TUNE_KEY = ["BLOCK_D", "G", "NUM_SRC", "SOFTMAX", "MIX_KEYS", "MIX_VALUES"]


@triton.jit
def _tile_offsets(i_s, i_b, i_h, stride_s, stride_b, stride_h, cols):
    """``[BLOCK_T, BLOCK_D]`` element offsets of head ``i_h`` of a ``[s, b, heads, hn]`` view."""
    return (i_s * stride_s + i_b * stride_b + i_h * stride_h)[:, None] + cols[None, :]


@triton.jit
def _group_mean(q, i_s, i_b, i_h, stride_qs, stride_qb, stride_qh, cols, mask,
                G: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Mean of the ``G`` query heads of KV head ``i_h``: ``[BLOCK_T, BLOCK_D]`` in ACC."""
    q_bar = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    for g in tl.static_range(G):
        o_q = _tile_offsets(i_s, i_b, i_h * G + g, stride_qs, stride_qb, stride_qh, cols)
        q_bar += tl.load(q + o_q, mask=mask, other=0.0).to(ACC)
    return q_bar / G


@triton.autotune(configs=_configs(), key=_TUNE_KEY,
                 prune_configs_by={"early_config_prune": _prune_fwd})
@triton.jit
def depth_mix_fwd_kernel(
    q, k, v, src_k, src_v,                      # inputs; src_k / src_v: tuples of pointers
    k_out, v_out, lse,                          # outputs, contiguous [N, NG, HD] / [N, NG]
    N, B, NG, HD,                               # rows N = s * b
    stride_qs, stride_qb, stride_qh,
    stride_ks, stride_kb, stride_kh,
    stride_vs, stride_vb, stride_vh,
    stride_sks, stride_skb, stride_skh,         # shared by every source key
    stride_svs, stride_svb, stride_svh,         # shared by every source value
    scale,
    G: tl.constexpr, NUM_SRC: tl.constexpr, SOFTMAX: tl.constexpr,
    MIX_KEYS: tl.constexpr, MIX_VALUES: tl.constexpr, ACC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    rows = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    m_t = rows < N
    mask = m_t[:, None] & (cols < HD)[None, :]
    rows = rows.to(tl.int64)
    i_s, i_b = rows // B, rows % B
    o_sk = _tile_offsets(i_s, i_b, i_h, stride_sks, stride_skb, stride_skh, cols)
    o_sv = _tile_offsets(i_s, i_b, i_h, stride_svs, stride_svb, stride_svh, cols)
    o_out = (rows * NG + i_h)[:, None] * HD + cols[None, :]

    # the layer itself (entry S of the weights)
    if SOFTMAX or MIX_KEYS:
        b_k = tl.load(k + _tile_offsets(i_s, i_b, i_h, stride_ks, stride_kb, stride_kh, cols),
                      mask=mask, other=0.0).to(ACC)
    if MIX_VALUES:
        b_v = tl.load(v + _tile_offsets(i_s, i_b, i_h, stride_vs, stride_vb, stride_vh, cols),
                      mask=mask, other=0.0).to(ACC)
    if SOFTMAX:
        q_bar = _group_mean(q, i_s, i_b, i_h, stride_qs, stride_qb, stride_qh, cols, mask,
                            G, ACC, BLOCK_T, BLOCK_D)
        b_m = tl.sum(q_bar * b_k, axis=1) * scale  # running max, [BLOCK_T]
        b_l = tl.full([BLOCK_T], 1.0, dtype=ACC)    # running Σ exp(z - m)
    if MIX_KEYS:
        acc_k = b_k
    if MIX_VALUES:
        acc_v = b_v

    # the sources, one pass, online softmax
    for j in tl.static_range(NUM_SRC):
        if SOFTMAX or MIX_KEYS:
            b_kj = tl.load(src_k[j] + o_sk, mask=mask, other=0.0).to(ACC)
        if MIX_VALUES:
            b_vj = tl.load(src_v[j] + o_sv, mask=mask, other=0.0).to(ACC)
        if SOFTMAX:
            b_z = tl.sum(q_bar * b_kj, axis=1) * scale
            m_new = tl.maximum(b_m, b_z)
            alpha = tl.exp(b_m - m_new)
            b_p = tl.exp(b_z - m_new)
            b_l = b_l * alpha + b_p
            b_m = m_new
            if MIX_KEYS:
                acc_k = acc_k * alpha[:, None] + b_p[:, None] * b_kj
            if MIX_VALUES:
                acc_v = acc_v * alpha[:, None] + b_p[:, None] * b_vj
        else:
            if MIX_KEYS:
                acc_k += b_kj
            if MIX_VALUES:
                acc_v += b_vj

    if SOFTMAX:
        b_w = 1.0 / b_l
        tl.store(lse + rows * NG + i_h, b_m + tl.log(b_l), mask=m_t)
    else:
        b_w = tl.full([BLOCK_T], 1.0 / (NUM_SRC + 1), dtype=ACC)
    if MIX_KEYS:
        acc_k = acc_k * b_w[:, None]
        tl.store(k_out + o_out, acc_k.to(k_out.dtype.element_ty), mask=mask)
    if MIX_VALUES:
        acc_v = acc_v * b_w[:, None]
        tl.store(v_out + o_out, acc_v.to(v_out.dtype.element_ty), mask=mask)


@triton.autotune(configs=_configs(), key=_TUNE_KEY,
                 prune_configs_by={"early_config_prune": _prune_bwd})
@triton.jit
def depth_mix_bwd_kernel(
    q, k, v, src_k, src_v, lse, dk_out, dv_out,  # forward inputs, saved stats, output grads
    dq, dk, dv, dsk, dsv,                        # grads: contiguous; dsk/dsv [NUM_SRC, N, NG, HD]
    N, B, NG, HD,
    stride_qs, stride_qb, stride_qh,
    stride_ks, stride_kb, stride_kh,
    stride_vs, stride_vb, stride_vh,
    stride_sks, stride_skb, stride_skh,
    stride_svs, stride_svb, stride_svh,
    stride_dks, stride_dkb, stride_dkh,          # grad of k_out
    stride_dvs, stride_dvb, stride_dvh,          # grad of v_out
    scale,
    G: tl.constexpr, NUM_SRC: tl.constexpr, SOFTMAX: tl.constexpr,
    MIX_KEYS: tl.constexpr, MIX_VALUES: tl.constexpr, ACC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    rows = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    m_t = rows < N
    mask = m_t[:, None] & (cols < HD)[None, :]
    rows = rows.to(tl.int64)
    i_s, i_b = rows // B, rows % B
    o_sk = _tile_offsets(i_s, i_b, i_h, stride_sks, stride_skb, stride_skh, cols)
    o_sv = _tile_offsets(i_s, i_b, i_h, stride_svs, stride_svb, stride_svh, cols)
    o_g = (rows * NG + i_h)[:, None] * HD + cols[None, :]  # contiguous [N, NG, HD] grads
    src_step = N * NG * HD                                  # one source in dsk / dsv

    if MIX_VALUES:
        b_dov = tl.load(dv_out + _tile_offsets(i_s, i_b, i_h, stride_dvs, stride_dvb,
                                               stride_dvh, cols), mask=mask, other=0.0).to(ACC)
    if MIX_KEYS:
        b_dok = tl.load(dk_out + _tile_offsets(i_s, i_b, i_h, stride_dks, stride_dkb,
                                               stride_dkh, cols), mask=mask, other=0.0).to(ACC)

    if SOFTMAX:
        q_bar = _group_mean(q, i_s, i_b, i_h, stride_qs, stride_qb, stride_qh, cols, mask,
                            G, ACC, BLOCK_T, BLOCK_D)
        b_lse = tl.load(lse + rows * NG + i_h, mask=m_t, other=0.0)
        b_k = tl.load(k + _tile_offsets(i_s, i_b, i_h, stride_ks, stride_kb, stride_kh, cols),
                      mask=mask, other=0.0).to(ACC)
        a_self = tl.exp(tl.sum(q_bar * b_k, axis=1) * scale - b_lse)
        da_self = tl.zeros([BLOCK_T], dtype=ACC)
        if MIX_VALUES:
            b_v = tl.load(v + _tile_offsets(i_s, i_b, i_h, stride_vs, stride_vb, stride_vh,
                                            cols), mask=mask, other=0.0).to(ACC)
            da_self += tl.sum(b_dov * b_v, axis=1)
        if MIX_KEYS:
            da_self += tl.sum(b_dok * b_k, axis=1)
        b_delta = a_self * da_self  # Δ = Σ_j a_j da_j

        # pass 1: weights and their gradients; value gradients
        cols_s = tl.arange(0, BLOCK_S)[None, :]
        b_a = tl.zeros([BLOCK_T, BLOCK_S], dtype=ACC)
        b_da = tl.zeros([BLOCK_T, BLOCK_S], dtype=ACC)
        for j in tl.static_range(NUM_SRC):
            b_kj = tl.load(src_k[j] + o_sk, mask=mask, other=0.0).to(ACC)
            b_aj = tl.exp(tl.sum(q_bar * b_kj, axis=1) * scale - b_lse)
            b_daj = tl.zeros([BLOCK_T], dtype=ACC)
            if MIX_VALUES:
                b_vj = tl.load(src_v[j] + o_sv, mask=mask, other=0.0).to(ACC)
                b_daj += tl.sum(b_dov * b_vj, axis=1)
                tl.store(dsv + j * src_step + o_g,
                         (b_aj[:, None] * b_dov).to(dsv.dtype.element_ty), mask=mask)
            if MIX_KEYS:
                b_daj += tl.sum(b_dok * b_kj, axis=1)
            b_delta += b_aj * b_daj
            b_a = tl.where(cols_s == j, b_aj[:, None], b_a)
            b_da = tl.where(cols_s == j, b_daj[:, None], b_da)

        # the layer itself: dz = a (da - Δ)
        dz_self = a_self * (da_self - b_delta)
        dq_bar = dz_self[:, None] * b_k
        b_dk = (scale * dz_self)[:, None] * q_bar
        if MIX_KEYS:
            b_dk += a_self[:, None] * b_dok
        tl.store(dk + o_g, b_dk.to(dk.dtype.element_ty), mask=mask)
        if MIX_VALUES:
            tl.store(dv + o_g, (a_self[:, None] * b_dov).to(dv.dtype.element_ty), mask=mask)

        # pass 2: score gradients of the sources (re-reads k_j)
        for j in tl.static_range(NUM_SRC):
            b_kj = tl.load(src_k[j] + o_sk, mask=mask, other=0.0).to(ACC)
            b_aj = tl.sum(tl.where(cols_s == j, b_a, 0.0), axis=1)
            b_daj = tl.sum(tl.where(cols_s == j, b_da, 0.0), axis=1)
            b_dzj = b_aj * (b_daj - b_delta)
            dq_bar += b_dzj[:, None] * b_kj
            b_dkj = (scale * b_dzj)[:, None] * q_bar
            if MIX_KEYS:
                b_dkj += b_aj[:, None] * b_dok
            tl.store(dsk + j * src_step + o_g, b_dkj.to(dsk.dtype.element_ty), mask=mask)

        # every query head of the group gets scale * dq̄ / G
        dq_bar = dq_bar * (scale / G)
        o_dq = (rows * NG * G + i_h * G)[:, None] * HD + cols[None, :]
        for g in tl.static_range(G):
            tl.store(dq + o_dq + g * HD, dq_bar.to(dq.dtype.element_ty), mask=mask)
    else:
        # uniform weights: the gradients are scaled copies of the output gradients
        w = 1.0 / (NUM_SRC + 1)
        if MIX_VALUES:
            b_dv = (b_dov * w).to(dv.dtype.element_ty)
            tl.store(dv + o_g, b_dv, mask=mask)
            for j in tl.static_range(NUM_SRC):
                tl.store(dsv + j * src_step + o_g, b_dv.to(dsv.dtype.element_ty), mask=mask)
        if MIX_KEYS:
            b_dk = (b_dok * w).to(dk.dtype.element_ty)
            tl.store(dk + o_g, b_dk, mask=mask)
            for j in tl.static_range(NUM_SRC):
                tl.store(dsk + j * src_step + o_g, b_dk.to(dsk.dtype.element_ty), mask=mask)


# ---- host launchers ------------------------------------------------------------------------
def _heads_strides(x: Tensor) -> Tuple[int, int, int]:
    stride = x.stride()
    assert stride[-1] == 1, "the head dim must be contiguous"
    return stride[:3]


def _shared_strides(sources: Sequence[Tensor]) -> Tuple[Tuple[Tensor, ...], Tuple[int, int, int]]:
    """Sources as a tuple with one common set of strides. Depth state entries normally
    share them already (contiguous tensors, views of one buffer or of the packed pipeline
    tensor); otherwise they are made contiguous (a copy, only in that case)."""
    sources = tuple(sources)
    if not sources:
        return (), (0, 0, 0)
    stride = sources[0].stride()
    if stride[-1] != 1 or any(s.stride() != stride for s in sources):
        sources = tuple(s.contiguous() for s in sources)
    return sources, _heads_strides(sources[0])


def _launch_geometry(query: Tensor, key: Tensor):
    s, b, np_, hn = query.shape
    ng = key.shape[2]
    if hn > MAX_HEAD_DIM:
        raise ValueError(f"depth_mix kernel supports head dims <= {MAX_HEAD_DIM}, got {hn}")
    if np_ % ng:
        raise ValueError(f"{np_} query heads are not a multiple of {ng} KV heads")
    block_d = max(16, next_power_of_2(hn))
    return s * b, b, ng, hn, np_ // ng, block_d


def depth_mix_fwd(query: Tensor, key: Tensor, value: Tensor, src_keys: Sequence[Tensor],
                  src_values: Sequence[Tensor], *, softmax: bool, mix_keys: bool,
                  mix_values: bool, scale: float):
    """Returns ``(key_out | None, value_out | None, lse | None)``; ``lse [s, b, ng]`` fp32
    (fp64 for fp64 inputs) with ``softmax``. ``src_keys`` are needed for ``softmax`` or
    ``mix_keys``, ``src_values`` for ``mix_values``; both ``S >= 1`` entries like ``key``."""
    query, key, value = last_dim_contiguous(query, key, value)
    src_k, sk_strides = _shared_strides(src_keys if (softmax or mix_keys) else ())
    src_v, sv_strides = _shared_strides(src_values if mix_values else ())
    num_src = max(len(src_k), len(src_v))
    n, b, ng, hn, g, block_d = _launch_geometry(query, key)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device) if mix_keys else None
    v_out = torch.empty(value.shape, dtype=value.dtype, device=value.device) if mix_values else None
    lse = (torch.empty(key.shape[:3], dtype=acc_dtype(query.dtype), device=key.device)
           if softmax else None)
    grid = lambda meta: (cdiv(n, meta["BLOCK_T"]), ng)  # noqa: E731
    depth_mix_fwd_kernel[grid](
        query, key, value, src_k, src_v,
        k_out if mix_keys else key, v_out if mix_values else value, lse if softmax else key,
        n, b, ng, hn,
        *_heads_strides(query), *_heads_strides(key), *_heads_strides(value),
        *sk_strides, *sv_strides,
        scale,
        G=g, NUM_SRC=num_src, SOFTMAX=softmax, MIX_KEYS=mix_keys, MIX_VALUES=mix_values,
        ACC=tl_dtype(acc_dtype(query.dtype)), BLOCK_D=block_d,
    )
    return k_out, v_out, lse


def depth_mix_bwd(query: Tensor, key: Tensor, value: Tensor, src_keys: Sequence[Tensor],
                  src_values: Sequence[Tensor], lse: Optional[Tensor],
                  dk_out: Optional[Tensor], dv_out: Optional[Tensor], *, softmax: bool,
                  mix_keys: bool, mix_values: bool, scale: float):
    """Gradients ``(dq, dk, dv, dsrc_keys [S, ...], dsrc_values [S, ...])``; an entry is
    None where the forward did not depend on that input (``dq``, ``dsrc_keys`` without
    softmax or key mixing, ``dk`` likewise, ``dv``/``dsrc_values`` without value mixing).
    ``dk`` and ``dsrc_keys`` in value mode are the score gradients only."""
    query, key, value, dk_out, dv_out = last_dim_contiguous(query, key, value, dk_out, dv_out)
    uses_keys = softmax or mix_keys
    src_k, sk_strides = _shared_strides(src_keys if uses_keys else ())
    src_v, sv_strides = _shared_strides(src_values if mix_values else ())
    num_src = max(len(src_k), len(src_v))
    n, b, ng, hn, g, block_d = _launch_geometry(query, key)

    def new(like: Tensor, shape) -> Tensor:
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    dq = new(query, query.shape) if softmax else None
    dk = new(key, key.shape) if uses_keys else None
    dv = new(value, value.shape) if mix_values else None
    dsk = new(src_k[0], (num_src, *key.shape)) if uses_keys else None
    dsv = new(src_v[0], (num_src, *value.shape)) if mix_values else None
    dummy = key
    grid = lambda meta: (cdiv(n, meta["BLOCK_T"]), ng)  # noqa: E731
    depth_mix_bwd_kernel[grid](
        query, key, value, src_k, src_v, lse if softmax else dummy,
        dk_out if mix_keys else dummy, dv_out if mix_values else dummy,
        *(t if t is not None else dummy for t in (dq, dk, dv, dsk, dsv)),
        n, b, ng, hn,
        *_heads_strides(query), *_heads_strides(key), *_heads_strides(value),
        *sk_strides, *sv_strides,
        *(_heads_strides(dk_out) if mix_keys else (0, 0, 0)),
        *(_heads_strides(dv_out) if mix_values else (0, 0, 0)),
        scale,
        G=g, NUM_SRC=num_src, SOFTMAX=softmax, MIX_KEYS=mix_keys, MIX_VALUES=mix_values,
        ACC=tl_dtype(acc_dtype(query.dtype)), BLOCK_D=block_d,
        BLOCK_S=max(2, next_power_of_2(num_src)),
    )
    return dq, dk, dv, dsk, dsv
