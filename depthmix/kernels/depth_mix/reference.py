"""Depth-Attention's depth step in plain PyTorch (the reference every kernel is tested against).

The Depth-Attention paper, eqs. (2)-(3): at one token position, layer ``l``'s query attends over
the keys of
``l`` and of its source layers ``S(l)`` and mixes their values:

    a = softmax_{j in S(l) + [l]}( q̄_l · k_j / sqrt(d_h) )
    ṽ_l = a_l v_l + sum_{j in S(l)} a_j ṽ_j

``q̄`` is the mean of the ``G`` query heads of a KV group (section 3.3, GQA), so the step
runs at KV-head resolution. Everything is per token and per KV head: no sequence mixing.

The op boundary (what a fused kernel will implement with the same signature):

* inputs are the raw tensors, all of which already exist as activations: the layer's
  ``query/key/value`` (saved anyway for sequence attention's backward) and the sources'
  keys and mixed values (depth state, kept alive for the later layers that read them);
* outputs are the mixed ``(key, value)`` only. A fused op therefore saves
  nothing new but ``S + 1`` softmax statistics per token and KV head (``[s, b, ng]``) and
  recomputes the weights in backward: nothing of size ``S x T x d`` is stored;
* sources come either as a stacked ``[S, s, b, ng, hn]`` tensor — a slice or view of a
  preallocated depth buffer (with anchored sources, layer ``l`` reads a prefix of the
  anchor layers, so one buffer with one slot per anchor serves every layer without any
  per-layer concatenation) — or as a sequence of ``[s, b, ng, hn]`` tensors. This reference
  iterates over the leading dimension in both cases and never concatenates them either.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from depthmix.kernels.modes import MIX_RULES, MIXED_STATES


Sources = Union[Tensor, Sequence[Tensor], None]


def _as_list(sources: Sources) -> list:
    if sources is None:
        return []
    if isinstance(sources, Tensor):
        return list(sources.unbind(0))  # views of the buffer, no copy
    return list(sources)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math for 16-bit inputs; fp64 stays fp64 (tests)."""
    return torch.promote_types(dtype, torch.float32)


def depth_weights(query: Tensor, key: Tensor, src_keys: Sources = None, *,
                  num_sources: Optional[int] = None, mix_rule: str = "softmax",
                  scale: Optional[float] = None) -> Tensor:
    """Depth-attention weights ``[s, b, ng, S + 1]`` in fp32 (or fp64 for fp64 inputs).

    Entry ``j < S`` is source ``j`` (in the order given), entry ``S`` the layer itself.
    ``query [s, b, np, hn]``, ``key [s, b, ng, hn]``, ``src_keys`` ``S`` keys like ``key``.
    ``mix_rule="uniform"`` gives ``1 / (S + 1)`` and needs no keys (pass ``num_sources``).
    """
    if mix_rule not in MIX_RULES:
        raise ValueError(f"mix_rule={mix_rule!r} must be one of {MIX_RULES}")
    s, b, np_, hn = query.shape
    ng = key.shape[2]
    if np_ % ng:
        raise ValueError(f"{np_} query heads are not a multiple of {ng} KV heads")
    keys = _as_list(src_keys)
    n = len(keys) if num_sources is None else num_sources
    acc = _compute_dtype(key.dtype)
    if mix_rule == "uniform":
        return torch.full((s, b, ng, n + 1), 1.0 / (n + 1), dtype=acc, device=key.device)
    if len(keys) != n:
        raise ValueError(f"softmax depth mixing needs the keys of all {n} sources")
    scale = 1.0 / math.sqrt(hn) if scale is None else scale
    # GQA: one depth query per KV group, the mean of its G query heads
    q_bar = query.to(acc).view(s, b, ng, np_ // ng, hn).mean(dim=3)  # [s, b, ng, hn]
    scores = [(q_bar * k.to(acc)).sum(-1) for k in (*keys, key)]  # S + 1 x [s, b, ng]
    return torch.softmax(torch.stack(scores, dim=-1) * scale, dim=-1)  # [s, b, ng, S + 1]


def depth_mix_reference(query: Tensor, key: Tensor, value: Tensor, src_keys: Sources = None,
              src_values: Sources = None, *, mix_rule: str = "softmax",
              mixed_state: str = "value", scale: Optional[float] = None
              ) -> Tuple[Tensor, Tensor]:
    """Mix layer ``l``'s key/value with those of its depth sources at every token position.

    Args:
        query: ``[s, b, np, hn]`` the layer's queries (after QK-norm and RoPE).
        key, value: ``[s, b, ng, hn]`` the layer's own keys and values.
        src_keys: the ``S`` sources' keys ``k_j`` (raw: their own keys, which are also what
            their sequence attention reads in ``value`` mode), stacked ``[S, s, b, ng, hn]``
            or a sequence of ``[s, b, ng, hn]``. Needed for ``mix_rule="softmax"`` and for
            the key-mixing states; may be None otherwise.
        src_values: the ``S`` sources' *mixed* values ``ṽ_j``, same layout. Needed for
            ``mixed_state`` ``value`` and ``key_value``.
        mix_rule: ``softmax`` (the paper) or ``uniform`` (plain mean over the layer and its
            sources, the paper's "uniform mix" ablation, table 5).
        mixed_state: what the weights mix (table 6): ``value`` (default)
            ``ṽ_l = a_l v_l + Σ a_j ṽ_j``, key ``k`` unchanged; ``key``: ``k̃_l = a_l k_l +
            Σ a_j k_j`` (sources contribute their raw keys), value unchanged; ``key_value``:
            both.
        scale: score scale, default ``1 / sqrt(hn)``.

    Returns:
        ``(key_out, value_out)``, ``[s, b, ng, hn]`` in the input dtype. With no sources
        (``S = 0``) the inputs are returned as they are (the weight is 1).

    The weights are computed in fp32 (fp64 for fp64 inputs) and the mix accumulates in
    that precision.
    """
    if mixed_state not in MIXED_STATES:
        raise ValueError(f"mixed_state={mixed_state!r} must be one of {MIXED_STATES}")
    keys, values = _as_list(src_keys), _as_list(src_values)
    mix_keys = mixed_state in ("key", "key_value")
    mix_values = mixed_state in ("value", "key_value")
    n = len(values) if mix_values else len(keys)
    if mix_values and mix_keys and len(keys) != n:
        raise ValueError(f"{len(keys)} source keys for {n} source values")
    if n == 0:
        return key, value
    weights = depth_weights(query, key, keys if keys else None, num_sources=n,
                            mix_rule=mix_rule, scale=scale)  # [s, b, ng, S + 1]

    def mix(own: Tensor, sources: list) -> Tensor:
        acc = weights[..., n, None] * own.to(weights.dtype)
        for j, src in enumerate(sources):
            acc = acc + weights[..., j, None] * src.to(weights.dtype)
        return acc.to(own.dtype)

    key_out = mix(key, keys) if mix_keys else key
    value_out = mix(value, values) if mix_values else value
    return key_out, value_out
