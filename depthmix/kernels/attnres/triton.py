"""Fused Attention-Residuals aggregation: Triton kernels, then their host launchers.

One program owns a tile of ``BT`` tokens and the whole hidden row (``BD >= d``, the next
power of two; lanes past ``d`` are masked). The ``S`` sources are separate tensors,
passed as a **pointer table**: an int64 device tensor holding each source's
``data_ptr()``, cast back to a typed pointer inside the kernel. Nothing is stacked, the
number of sources is a runtime loop bound (one compiled kernel serves every sublayer of
Full and Block AttnRes), and the table costs one asynchronous 8-byte-per-pointer copy
from pinned host memory per launch (the backward's sources and gradients share one
table), so building it never waits for the device.

Forward (one pass over the sources, online softmax; ``qg = w * g`` so that the logit
``w . (g * y r) = r (y . qg)`` needs no normalised copy of ``y``)::

    for s:  r_s = rsqrt(mean(y_s^2) + eps);  z_s = r_s (y_s . qg)
            m' = max(m, z_s);  l = l e^{m - m'} + e^{z_s - m'}
            acc = acc e^{m - m'} + e^{z_s - m'} y_s
    o = acc / l;   optionally  o <- o * rsqrt(mean(o^2) + out_eps) * h

It writes ``o``, and per token the statistics backward needs: ``z [S, T]``, ``rstd [S, T]``
and ``lse [T]`` (fp32; fp64 for fp64 sources).

Backward (two passes over the sources, the minimum without keeping the output alive):
pass A recomputes the pre-norm output ``o = sum_s a_s y_s`` with ``a_s = exp(z_s - lse)``,
which gives ``do`` through the optional output norm and ``o . do = sum_s a_s (y_s . do)``;
pass B then forms every source's gradient in one read::

    dz_s = a_s (y_s . do - o . do)
    dy_s = a_s do + dz_s r_s (qg - (r_s z_s / d) y_s)

The pseudo-query and gain gradients are reductions over tokens,
``dqg = sum_{t,s} dz_s r_s y_s`` (``dw = dqg * g``, ``dg = dqg * w``) and, for the output
norm, ``dh = sum_t do_out * o_hat``. They are deterministic: the backward grid is a fixed
number of persistent programs (a multiple of the SM count), each walking the token tiles
``p, p + G, p + 2G, ...`` and accumulating in registers; each writes one fp32 partial row
``[G, d]`` (``[G, 2, d]`` with the output norm, its gain's beside) that the host sums in a
fixed order (no atomics).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from depthmix.kernels._common import (
    acc_dtype,
    cdiv,
    host_cache,
    next_power_of_2,
    sm_count,
    tl_dtype,
)

MAX_HIDDEN = 16384
"""Largest hidden size: the kernels keep a token's whole row in registers."""


@triton.jit
def attnres_fwd_kernel(
    src,  # int64 [S]: data pointers of the sources, each [T, D] contiguous
    q,  # [D] pseudo-query w
    g,  # [D] key-norm gain
    h,  # [D] output-norm gain (read only when NORM)
    o,  # [T, D] output, in the sources' dtype
    z,  # [S, T] logits
    rstd,  # [S, T] inverse RMS of each source
    lse,  # [T] log-sum-exp of the logits
    T,
    S,
    eps,
    out_eps,
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    NORM: tl.constexpr,
    ACC: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    # [BT], [BD]
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    # [BT, BD]
    m_td = m_t[:, None] & m_d[None, :]
    o_td = o_t[:, None] * D + o_d[None, :]

    # [BD]
    b_qg = tl.load(q + o_d, mask=m_d, other=0.).to(ACC) * tl.load(g + o_d, mask=m_d, other=0.).to(ACC)

    b_m = tl.full([BT], float("-inf"), dtype=ACC)
    b_l = tl.zeros([BT], dtype=ACC)
    b_acc = tl.zeros([BT, BD], dtype=ACC)
    for s in range(S):
        p_y = tl.load(src + s).to(o.dtype)
        # [BT, BD]
        b_y = tl.load(p_y + o_td, mask=m_td, other=0.).to(ACC)
        # [BT]
        b_r = 1. / tl.sqrt(tl.sum(b_y * b_y, axis=1) / D + eps)
        b_z = tl.sum(b_y * b_qg[None, :], axis=1) * b_r
        tl.store(rstd + s * T + o_t, b_r, mask=m_t)
        tl.store(z + s * T + o_t, b_z, mask=m_t)
        # online softmax over the sources
        b_mn = tl.maximum(b_m, b_z)
        b_alpha = tl.exp(b_m - b_mn)
        b_p = tl.exp(b_z - b_mn)
        b_l = b_l * b_alpha + b_p
        b_acc = b_acc * b_alpha[:, None] + b_p[:, None] * b_y
        b_m = b_mn

    b_o = b_acc / b_l[:, None]
    tl.store(lse + o_t, b_m + tl.log(b_l), mask=m_t)
    if NORM:
        b_h = tl.load(h + o_d, mask=m_d, other=0.).to(ACC)
        b_rho = 1. / tl.sqrt(tl.sum(b_o * b_o, axis=1) / D + out_eps)
        b_o = b_o * b_rho[:, None] * b_h[None, :]
    tl.store(o + o_td, b_o.to(o.dtype.element_ty), mask=m_td)


@triton.jit
def attnres_bwd_kernel(
    src,  # int64 [S]: data pointers of the sources
    dsrc,  # int64 [S]: data pointers of their gradients (written)
    q,
    g,
    h,
    do,  # [T, D] gradient of the output
    z,
    rstd,
    lse,
    dqg,  # [G, D] per-program partial of sum_{t,s} dz r y; NORM: [G, 2, D], then the
    # partial of the output-norm gain gradient
    T,
    S,
    out_eps,
    NT,  # number of token tiles
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    NORM: tl.constexpr,
    ACC: tl.constexpr,
):
    i_p = tl.program_id(0)
    G = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D

    # [BD]
    b_qg = tl.load(q + o_d, mask=m_d, other=0.).to(ACC) * tl.load(g + o_d, mask=m_d, other=0.).to(ACC)
    if NORM:
        b_h = tl.load(h + o_d, mask=m_d, other=0.).to(ACC)
    # [BT, BD] accumulators over all of this program's tokens
    b_dqg = tl.zeros([BT, BD], dtype=ACC)
    b_dh = tl.zeros([BT, BD], dtype=ACC)

    for i_t in range(i_p, NT, G):
        o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < T
        m_td = m_t[:, None] & m_d[None, :]
        o_td = o_t[:, None] * D + o_d[None, :]
        # [BT]
        b_lse = tl.load(lse + o_t, mask=m_t, other=0.)

        # pass A: the pre-norm output, o = sum_s a_s y_s
        b_o = tl.zeros([BT, BD], dtype=ACC)
        for s in range(S):
            p_y = tl.load(src + s).to(do.dtype)
            b_y = tl.load(p_y + o_td, mask=m_td, other=0.).to(ACC)
            b_a = tl.exp(tl.load(z + s * T + o_t, mask=m_t, other=0.) - b_lse)
            b_o += b_a[:, None] * b_y

        # [BT, BD]
        b_do = tl.load(do + o_td, mask=m_td, other=0.).to(ACC)
        if NORM:
            b_rho = 1. / tl.sqrt(tl.sum(b_o * b_o, axis=1) / D + out_eps)
            b_oh = b_o * b_rho[:, None]
            b_dh += b_do * b_oh
            b_go = b_do * b_h[None, :]
            b_c = tl.sum(b_oh * b_go, axis=1) / D
            b_do = b_rho[:, None] * (b_go - b_oh * b_c[:, None])
        # [BT]
        b_od = tl.sum(b_o * b_do, axis=1)

        # pass B: every source's gradient
        for s in range(S):
            p_y = tl.load(src + s).to(do.dtype)
            p_dy = tl.load(dsrc + s).to(do.dtype)
            b_y = tl.load(p_y + o_td, mask=m_td, other=0.).to(ACC)
            b_z = tl.load(z + s * T + o_t, mask=m_t, other=0.)
            b_r = tl.load(rstd + s * T + o_t, mask=m_t, other=0.)
            b_a = tl.exp(b_z - b_lse)
            # [BT]
            b_dzr = b_a * (tl.sum(b_y * b_do, axis=1) - b_od) * b_r
            b_dy = (b_a[:, None] * b_do + b_dzr[:, None] * b_qg[None, :]
                    - (b_dzr * b_r * b_z / D)[:, None] * b_y)
            tl.store(p_dy + o_td, b_dy.to(p_dy.dtype.element_ty), mask=m_td)
            b_dqg += b_dzr[:, None] * b_y

    row = dqg + i_p * (2 * D if NORM else D)
    tl.store(row + o_d, tl.sum(b_dqg, axis=0), mask=m_d)
    if NORM:
        tl.store(row + D + o_d, tl.sum(b_dh, axis=0), mask=m_d)


# ---------------------------------------------------------------------------------------
# Host launchers
# ---------------------------------------------------------------------------------------


@host_cache
def _tiles(d: int) -> Tuple[int, int, int]:
    """(BT tokens, BD hidden lanes, num_warps) for hidden size ``d``: about 2K elements
    per program, 8 per thread (a 16-byte vector for bf16)."""
    bd = next_power_of_2(d)
    bt = max(1, 2048 // bd)
    warps = min(16, max(1, bt * bd // 256))
    return bt, bd, warps


def _pointer_table(*groups: Sequence[Tensor], device) -> Tuple[Tensor, ...]:
    """One int64 device table of the ``data_ptr()`` of every tensor in ``groups`` and a
    view of it per group. Written into pinned host memory and copied without blocking
    (the caching host allocator keeps the buffer until the copy has run); each group
    starts at an even entry so every view keeps the table's 16-byte alignment (one
    compiled kernel)."""
    starts, ptrs = [], []
    for group in groups:
        starts.append(len(ptrs))
        ptrs += [t.data_ptr() for t in group] + [0] * (len(group) % 2)
    host = torch.tensor(ptrs, dtype=torch.int64, pin_memory=device.type == "cuda")
    table = host.to(device, non_blocking=True)
    return tuple(table[start:] if start else table for start in starts)


def _num_programs(tiles: int, device) -> int:
    """Persistent backward grid: a few programs per SM (fixed per device, so the token
    reduction order, and hence the gains' gradients, are deterministic)."""
    return max(1, min(tiles, 4 * sm_count(device)))


def check_sources(sources: Sequence[Tensor]) -> List[Tensor]:
    """Validates the list and returns each source contiguous (a no-op for the usual
    contiguous activations; the sources are never stacked)."""
    if len(sources) == 0:
        raise ValueError("attnres needs at least one source")
    first = sources[0]
    for i, y in enumerate(sources):
        if y.shape != first.shape or y.dtype != first.dtype or y.device != first.device:
            raise ValueError(f"attnres: source {i} is {tuple(y.shape)} {y.dtype} on {y.device}, "
                             f"source 0 is {tuple(first.shape)} {first.dtype} on {first.device}")
    if first.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"attnres kernel: hidden size {first.shape[-1]} > {MAX_HIDDEN}")
    return [y.contiguous() for y in sources]


def attnres_fwd(
    sources: Sequence[Tensor],
    query: Tensor,
    key_weight: Tensor,
    eps: float,
    out_weight: Optional[Tensor],
    out_eps: float,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``out [*, d]`` and the statistics ``z [S, T]``, ``rstd [S, T]``, ``lse [T]``
    (``T`` = the tokens of ``*``, i.e. the rank's shard)."""
    first = sources[0]
    d = first.shape[-1]
    t = first.numel() // d
    acc = acc_dtype(first.dtype)
    out = torch.empty_like(first)
    z = torch.empty(len(sources), t, dtype=acc, device=first.device)
    rstd = torch.empty_like(z)
    lse = torch.empty(t, dtype=acc, device=first.device)
    bt, bd, warps = _tiles(d)
    norm = out_weight is not None
    (table,) = _pointer_table(sources, device=first.device)
    attnres_fwd_kernel[(cdiv(t, bt),)](
        table, query, key_weight,
        out_weight if norm else query, out, z, rstd, lse,
        t, len(sources), eps, out_eps,
        D=d, BT=bt, BD=bd, NORM=norm, ACC=tl_dtype(acc), num_warps=warps,
    )
    return out, z, rstd, lse


def attnres_bwd(
    sources: Sequence[Tensor],
    query: Tensor,
    key_weight: Tensor,
    out_weight: Optional[Tensor],
    out_eps: float,
    dout: Tensor,
    z: Tensor,
    rstd: Tensor,
    lse: Tensor,
    grads_as_views: bool = False,
) -> Tuple[List[Tensor], Tensor, Tensor, Optional[Tensor]]:
    """Returns (gradients of the sources, of ``query``, of ``key_weight``, of
    ``out_weight`` or None). ``grads_as_views``: the source gradients are views of one
    ``[S, *, d]`` buffer (one allocation instead of ``S``; a custom op may not return
    outputs that alias each other, an ``autograd.Function`` may)."""
    first = sources[0]
    d = first.shape[-1]
    t = first.numel() // d
    acc = acc_dtype(first.dtype)
    dout = dout.contiguous()
    if grads_as_views:
        dsources = list(first.new_empty((len(sources), *first.shape)).unbind(0))
    else:
        dsources = [torch.empty_like(y) for y in sources]
    bt, bd, warps = _tiles(d)
    tiles = cdiv(t, bt)
    programs = _num_programs(tiles, first.device)
    norm = out_weight is not None
    dqg = torch.empty((programs, 2, d) if norm else (programs, d), dtype=acc,
                      device=first.device)
    source_table, grad_table = _pointer_table(sources, dsources, device=first.device)
    attnres_bwd_kernel[(programs,)](
        source_table, grad_table,
        query, key_weight, out_weight if norm else query, dout, z, rstd, lse, dqg,
        t, len(sources), out_eps, tiles,
        D=d, BT=bt, BD=bd, NORM=norm, ACC=tl_dtype(acc), num_warps=warps,
    )
    dqg = dqg.sum(0)  # fixed-order reduction of the per-program partials
    dout_weight = None
    if norm:
        dqg, dh = dqg.unbind(0)
        dout_weight = dh.to(out_weight.dtype)
    dquery = (dqg * key_weight.to(acc)).to(query.dtype)
    dkey = (dqg * query.to(acc)).to(key_weight.dtype)
    return dsources, dquery, dkey, dout_weight
