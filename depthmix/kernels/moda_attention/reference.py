"""Mixture-of-depths attention in plain PyTorch: the reference for the fused kernel.

One MoDA attention call (MoDA paper, Alg. 1): every query head attends, under **one**
softmax, to the causal sequence keys of its layer and to the depth keys of its own token
position::

    scores_t = [ q_t . k_j / sqrt(d)  for j <= t ]  ++  [ q_t . K^dep_{t,i} / sqrt(d)  for i < n ]
    p_t      = softmax(scores_t)                                   (fp32)
    o_t      = sum_j p_t[j] v_j  +  sum_i p_t[i] V^dep_{t,i}

Visibility rule: query position ``t`` sees sequence keys ``j <= t`` (causal) and only the
depth entries stored at position ``t`` (the paper's masks ``floor(i_q/G) >= i_k`` and
``floor(i_q/G) = floor(j_d/D)``). GQA: query head ``h`` reads KV head ``h // G`` for both
the sequence and the depth part (Megatron's head order: a group's G query heads are
adjacent).

Depth-KV layout: ``[s, b, ng, D, hn]`` plus an optional ``depth_count``. This is the
sequence K/V layout of Megatron (``[s, b, ng, hn]``) with the depth axis inserted before
the head dim, so that

* each (token, sample, KV head) owns one contiguous ``D x hn`` tile: the paper's
  "``[T*D]`` per KV head, the D depth entries of a token contiguous" layout, up to the
  batch stride. A query tile of C rows (C/G tokens after group-aware indexing) reads
  exactly its C/G such tiles: chunk-aware reads with no masked-out waste;
* the sequence axis stays first, like every other attention-side tensor here, so the KV
  cache and incremental decoding slice it the same way (the depth KV of a forward covers
  exactly that forward's query positions);
* ``depth_count`` (entries ``>= depth_count`` are ignored) lets the fused kernel keep one
  zero-filled, preallocated buffer of capacity ``D`` (e.g. ``depth_window``) and a
  current-depth counter instead of reallocating as the depth grows. The order of the
  valid entries does not matter (the softmax is permutation invariant), so a slot buffer
  may overwrite the oldest entry in place.

It is the contract of the Triton paths, same arguments: the split one
(``moda_attention_triton``, ``split.py``: SDPA's attention for the sequence part, a Triton
kernel for the depth part, merged by their log-sum-exps) and the fused kernel
(``moda_attention_fused``, ``function.py``: one online softmax over the sequence blocks and
the token's depth tile). This reference materialises the ``[b, np, sq, sk + D]`` fp32 scores and
probabilities (saved for backward): fine for tests and short sequences, the kernel's job
beyond that.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def _check_shapes(query: Tensor, key: Tensor, depth_key: Optional[Tensor]) -> tuple:
    sq, b, np_, hn = query.shape
    sk, bk, ng, hk = key.shape
    if bk != b or hk != hn or np_ % ng:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} do not match "
                         "([sq, b, np, hn] / [sk, b, ng, hn] with np % ng == 0)")
    if sk < sq:
        raise ValueError(f"{sq} queries need at least as many keys (got {sk})")
    if depth_key is not None and (depth_key.dim() != 5
                                  or tuple(depth_key.shape[:3]) != (sq, b, ng)
                                  or depth_key.shape[4] != hn):
        raise ValueError(f"depth_key {tuple(depth_key.shape)} must be [sq, b, ng, D, hn] = "
                         f"[{sq}, {b}, {ng}, D, {hn}]")
    return sq, b, np_, hn, sk, ng


def _scores(query: Tensor, key: Tensor, depth_key: Optional[Tensor],
            depth_count: Optional[int], softmax_scale: Optional[float],
            attention_mask: Optional[Tensor] = None) -> tuple:
    """fp32 (fp64 for fp64 inputs) scores ``[b, ng, G, sq, sk + D]``, masked with -inf."""
    sq, b, np_, hn, sk, ng = _check_shapes(query, key, depth_key)
    g = np_ // ng
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
    acc = torch.promote_types(query.dtype, torch.float32)
    q = query.to(acc).view(sq, b, ng, g, hn)
    seq = torch.einsum("sbngh,tbnh->bngst", q, key.to(acc)) * scale  # [b, ng, G, sq, sk]
    pos_q = torch.arange(sk - sq, sk, device=query.device)[:, None]
    visible = torch.arange(sk, device=query.device)[None, :] <= pos_q  # [sq, sk]
    if attention_mask is not None:  # [b, 1, sq, sk], causality included
        visible = attention_mask[:, :, None]  # [b, 1, 1, sq, sk]
    seq = seq.masked_fill(~visible, float("-inf"))
    if depth_key is None:
        return seq, sk, 0, acc
    d = depth_key.shape[3]
    dep = torch.einsum("sbngh,sbndh->bngsd", q, depth_key.to(acc)) * scale  # [b, ng, G, sq, D]
    if depth_count is not None and depth_count < d:
        valid = torch.arange(d, device=query.device) < depth_count
        dep = dep.masked_fill(~valid, float("-inf"))
    return torch.cat([seq, dep], dim=-1), sk, d, acc


def moda_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    depth_key: Optional[Tensor] = None,
    depth_value: Optional[Tensor] = None,
    depth_count: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    attention_mask: Optional[Tensor] = None,
) -> Tensor:
    """Causal sequence attention and same-position depth attention under one softmax.

    Args:
        query: ``[sq, b, np, hn]``, the last ``sq`` positions (query ``i`` sits at
            position ``sk - sq + i``; ``sq < sk`` in incremental decoding).
        key, value: ``[sk, b, ng, hn]`` sequence keys/values (``np % ng == 0``).
        depth_key, depth_value: ``[sq, b, ng, D, hn]``, the depth entries of each query
            position (None or ``D = 0``: plain causal attention).
        depth_count: only the first ``depth_count`` depth entries are valid (a
            preallocated, zero-filled buffer); None means all ``D``.
        softmax_scale: defaults to ``1 / sqrt(hn)``.
        attention_mask: visible sequence keys ``[b, 1, sq, sk]`` (True = visible,
            causality included) in place of the causal rule, e.g. the padding mask of a
            left-padded batch in generation; depth entries are unaffected (same position).

    Returns:
        ``[sq, b, np * hn]`` in the query's dtype. Scores, softmax and accumulation run in
        fp32 (fp64 for fp64 inputs) whatever the activations' dtype.
    """
    if (depth_key is None) != (depth_value is None):
        raise ValueError("depth_key and depth_value go together")
    if depth_key is not None and depth_value.shape != depth_key.shape:
        raise ValueError(f"depth_value {tuple(depth_value.shape)} != depth_key "
                         f"{tuple(depth_key.shape)}")
    scores, sk, d, acc = _scores(query, key, depth_key, depth_count, softmax_scale,
                                 attention_mask)
    probs = torch.softmax(scores, dim=-1)  # [b, ng, G, sq, sk + D]
    out = torch.einsum("bngst,tbnh->sbngh", probs[..., :sk], value.to(acc))
    if d:
        out = out + torch.einsum("bngsd,sbndh->sbngh", probs[..., sk:], depth_value.to(acc))
    sq, b = query.shape[:2]
    return out.reshape(sq, b, -1).to(query.dtype)


@torch.no_grad()
def moda_depth_weights(
    query: Tensor,
    key: Tensor,
    depth_key: Tensor,
    depth_count: Optional[int] = None,
    softmax_scale: Optional[float] = None,
) -> Tensor:
    """The softmax mass of each depth entry, ``[sq, b, np, D]`` (fp32; statistics only).

    ``1 - weights.sum(-1)`` is the mass on the sequence keys. Same arguments as
    :func:`moda_attention_reference`.
    """
    scores, sk, d, _ = _scores(query, key, depth_key, depth_count, softmax_scale)
    probs = torch.softmax(scores, dim=-1)[..., sk:]  # [b, ng, G, sq, D]
    b, ng, g, sq, _ = probs.shape
    return probs.permute(3, 0, 1, 2, 4).reshape(sq, b, ng * g, d).float()
