"""Rotary position embedding with its tables made once per forward.

Megatron's unfused ``apply_rotary_pos_emb`` (the ``[s, b, heads, d]`` layout, halves not
interleaved) computes ``t * cos + rotate_half(t) * sin`` with ``rotate_half(t) = cat(-t2,
t1)``, recomputing ``cos`` and ``sin`` of the frequencies at every call and copying ``t``
through two slices and a ``cat``: 13 ops forward, about as many backward, for each query
and key of every layer. :func:`apply_rope` computes the same numbers with the sign of the
rotation folded into the sine table once per forward, ``t * cos + roll(t, d / 2) * sin'``
with ``sin' = cat(-sin1, sin2)``: ``(-a) b`` and ``a (-b)`` are the same float, and the
sums add the same two products in the same order, so outputs and gradients are bit for bit
Megatron's (4 ops forward, 4 backward).
"""

from __future__ import annotations

from typing import Tuple

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from torch import Tensor

from depthmix.megatron_ext.context import ForwardContext


def rope_tables(freqs: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(cos, sin')`` of the frequencies ``[s, 1 or b, 1, d]`` in ``dtype`` (Megatron casts
    its ``cos`` / ``sin`` to the rotated tensor's dtype too); ``sin'`` carries
    ``rotate_half``'s sign: ``-sin`` on the first half, ``sin`` on the second."""
    half = freqs.shape[-1] // 2
    sin = torch.sin(freqs)
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return torch.cos(freqs).to(dtype), signed.to(dtype)


def apply_rope(t: Tensor, ctx: ForwardContext, config) -> Tensor:
    """``t [s, b, heads, d]`` rotated by ``ctx.rotary_pos_emb``, as Megatron's
    ``apply_rotary_pos_emb(t, freqs, config)``. The tables are made once per forward and
    dtype (``ctx.extras``; a compiled layer makes its own, which Inductor fuses); options
    this does not cover (TE's fused RoPE, interleaved halves, a partial rotary dim) take
    Megatron's function."""
    freqs = ctx.rotary_pos_emb
    if (config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention
            or freqs.shape[-1] != t.shape[-1]):
        return apply_rotary_pos_emb(t, freqs, config=config)
    if torch.compiler.is_compiling():
        cos, sin = rope_tables(freqs, t.dtype)
    else:
        key = ("rope", t.dtype)
        tables = ctx.extras.get(key)
        if tables is None or tables[0] is not freqs:
            tables = ctx.extras[key] = (freqs, *rope_tables(freqs, t.dtype))
        _, cos, sin = tables
    return t * cos + t.roll(t.shape[-1] // 2, dims=-1) * sin
