"""``moda_attention``: the fused Triton kernel as two PyTorch custom ops
(``mixer.moda_kernel=fused``; the default Triton path is the split one, ``split.py``).

``depthmix::moda_attention_fwd`` / ``depthmix::moda_attention_bwd`` (``torch.library``, with
fake implementations and a registered autograd formula; see
:mod:`depthmix.kernels._common`), so a compiled layer calls them without a graph break.
Saved for backward: the inputs, the output and one fp32 log-sum-exp per query row; the
backward recomputes the probabilities.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

import torch
import triton
from torch import Tensor

from depthmix.kernels._common import absent, empty_like_contiguous, last_dim_contiguous, present
from depthmix.kernels.moda_attention.reference import _check_shapes
from depthmix.kernels.moda_attention.triton import (
    Tiles,
    default_tiles,
    moda_attention_bwd,
    moda_attention_fwd,
)


@torch.library.custom_op("depthmix::moda_attention_fwd", mutates_args=())
def _fwd(query: Tensor, key: Tensor, value: Tensor, depth_key: Optional[Tensor],
         depth_value: Optional[Tensor], count: int, scale: float, tiles: List[int]
         ) -> Tuple[Tensor, Tensor]:
    """``(o [sq, b, np, hn], lse [b * ng, sq * GP])``; ``tiles`` are a :class:`Tiles`' fields."""
    return moda_attention_fwd(query, key, value, depth_key, depth_value, count, scale,
                              Tiles(*tiles))


@_fwd.register_fake
def _(query, key, value, depth_key, depth_value, count, scale, tiles):
    sq, b, np_, _ = query.shape
    ng = key.shape[2]
    lse = query.new_empty(b * ng, sq * triton.next_power_of_2(np_ // ng), dtype=torch.float32)
    return empty_like_contiguous(query), lse


@torch.library.custom_op("depthmix::moda_attention_bwd", mutates_args=())
def _bwd(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
         depth_key: Optional[Tensor], depth_value: Optional[Tensor], out: Tensor, lse: Tensor,
         count: int, scale: float, tiles: List[int]
         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, ddepth_key, ddepth_value)``; the depth gradients are empty without
    depth inputs."""
    dq, dk, dv, dkd, dvd = moda_attention_bwd(grad_out, query, key, value, depth_key,
                                              depth_value, out, lse, count, scale, Tiles(*tiles))
    return dq, dk, dv, present(dkd, query), present(dvd, query)


@_bwd.register_fake
def _(grad_out, query, key, value, depth_key, depth_value, out, lse, count, scale, tiles):
    like = empty_like_contiguous
    has_depth = depth_key is not None and count > 0
    depth_grads = (like(depth_key), like(depth_value)) if has_depth else (query.new_empty(0),) * 2
    return (like(query), like(key), like(value), *depth_grads)


def _setup_context(ctx, inputs, output):
    query, key, value, depth_key, depth_value, ctx.count, ctx.scale, ctx.tiles = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(query, key, value, depth_key, depth_value, out, lse)


def _backward(ctx, grad_out, _dlse):
    query, key, value, depth_key, depth_value, out, lse = ctx.saved_tensors
    dq, dk, dv, dkd, dvd = torch.ops.depthmix.moda_attention_bwd(
        grad_out, query, key, value, depth_key, depth_value, out, lse, ctx.count, ctx.scale,
        ctx.tiles)
    return dq, dk, dv, absent(dkd), absent(dvd), None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def moda_attention_fused(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    depth_key: Optional[Tensor] = None,
    depth_value: Optional[Tensor] = None,
    depth_count: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    tiles: Optional[Tiles] = None,
) -> Tensor:
    """Causal sequence attention and same-position depth attention under one softmax, fused
    (one flash-style Triton kernel for both parts; ``mixer.moda_kernel=fused``).

    Visibility rule: query ``i`` (position ``sk - sq + i``) sees the causal sequence keys
    ``j <= sk - sq + i`` and **only its own position's depth entries**
    ``depth_key[i, :, :, :depth_count]`` -- never another position's. GQA: query head ``h``
    reads KV head ``h // G`` for both (a group's ``G`` heads adjacent, Megatron's order).

    Args:
        query: ``[sq, b, np, hn]``, the last ``sq`` positions (``sq < sk``: decoding).
        key, value: ``[sk, b, ng, hn]`` sequence keys/values (``np % ng == 0``).
        depth_key, depth_value: ``[sq, b, ng, D, hn]``, each position's depth entries (None
            or ``D = 0``: plain causal attention).
        depth_count: only the first ``depth_count`` entries are valid (a preallocated,
            zero-filled buffer of capacity ``D``); the rest are never read and get zero
            gradient. None means all ``D``.
        softmax_scale: defaults to ``1 / sqrt(hn)``.
        tiles: tile sizes (default: :func:`~depthmix.kernels.moda_attention.triton.default_tiles`).

    Returns:
        ``[sq, b, np * hn]`` in the query's dtype (fp32, bf16 or fp16 inputs). Scores,
        softmax statistics and accumulation are fp32. CUDA tensors (or CPU tensors under
        ``TRITON_INTERPRET=1``); head dims up to 256 (padded to a power of two inside).
    """
    if (depth_key is None) != (depth_value is None):
        raise ValueError("depth_key and depth_value go together")
    if depth_key is not None and depth_value.shape != depth_key.shape:
        raise ValueError(f"depth_value {tuple(depth_value.shape)} != depth_key "
                         f"{tuple(depth_key.shape)}")
    sq, b, np_, hn, sk, ng = _check_shapes(query, key, depth_key)
    if hn > 256:
        raise ValueError(f"moda_attention (Triton) supports head dims <= 256, got {hn}")
    if not (query.dtype == key.dtype == value.dtype) or (
            depth_key is not None and not depth_key.dtype == depth_value.dtype == query.dtype):
        raise TypeError("query, key, value and the depth tensors must share one dtype")
    d = 0 if depth_key is None else depth_key.shape[3]
    count = d if depth_count is None else max(0, min(int(depth_count), d))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
    if tiles is None:
        tiles = default_tiles(hn, np_ // ng, d)
    q, k, v, kd, vd = last_dim_contiguous(query, key, value, depth_key, depth_value)
    out, _lse = torch.ops.depthmix.moda_attention_fwd(q, k, v, kd, vd, count, scale,
                                                     list(dataclasses.astuple(tiles)))
    return out.view(sq, b, -1)
