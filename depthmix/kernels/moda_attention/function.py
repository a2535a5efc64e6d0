"""``moda_attention``: the fused Triton kernel behind one ``torch.autograd.Function``."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from depthmix.kernels._common import last_dim_contiguous
from depthmix.kernels.moda_attention.reference import _check_shapes
from depthmix.kernels.moda_attention.triton import (
    Tiles,
    default_tiles,
    moda_attention_bwd,
    moda_attention_fwd,
)


class MoDAAttentionFunction(torch.autograd.Function):
    """Saves the inputs, the output and one fp32 log-sum-exp per query row; the backward
    recomputes the probabilities."""

    @staticmethod
    def forward(ctx, query, key, value, depth_key, depth_value, count, scale, tiles):
        o, lse = moda_attention_fwd(query, key, value, depth_key, depth_value, count, scale,
                                    tiles)
        ctx.save_for_backward(query, key, value, depth_key, depth_value, o, lse)
        ctx.count, ctx.scale, ctx.tiles = count, scale, tiles
        sq, b = query.shape[:2]
        return o.view(sq, b, -1)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, depth_key, depth_value, o, lse = ctx.saved_tensors
        dq, dk, dv, dkd, dvd = moda_attention_bwd(grad_out, query, key, value, depth_key,
                                                  depth_value, o, lse, ctx.count, ctx.scale,
                                                  ctx.tiles)
        return dq, dk, dv, dkd, dvd, None, None, None


def moda_attention_triton(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    depth_key: Optional[Tensor] = None,
    depth_value: Optional[Tensor] = None,
    depth_count: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    tiles: Optional[Tiles] = None,
) -> Tensor:
    """Causal sequence attention and same-position depth attention under one softmax, fused.

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
    return MoDAAttentionFunction.apply(q, k, v, kd, vd, count, scale, tiles)
