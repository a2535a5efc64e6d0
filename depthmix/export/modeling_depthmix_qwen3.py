"""Depth-Attention on Hugging Face's Qwen3 (remote code shipped with a depthmix export).

Depth-Attention (the Depth-Attention paper, eqs. 2-3, GQA as in its section 3.3) adds no
parameters: the weights are Qwen3's. Inside attention layer ``l``, after QK-norm and RoPE
and before sequence attention, at every token position and per KV group::

    q̄   = mean of the group's G query heads
    a_j  = softmax_j( q̄ · k_j / sqrt(head_dim) ),  j in S(l) ∪ {l}  (fp32; uniform: 1/(|S|+1))
    ṽ_l = a_l v_l + Σ_{j in S(l)} a_j ṽ_j           (sources contribute their mixed values)

and sequence attention runs on ``(q_l, k_l, ṽ_l)``; ``ṽ_l`` is what the KV cache stores.
Sources ``S(l)``: ``anchored`` ``{j < l : j % stride == 0}``, ``relative`` ``{l - stride,
l - 2 stride, ...}``. Same-position scores are RoPE-invariant, so scoring after RoPE is
exact. Only ``mixed_state=value`` is implemented here.

Load with ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``. This file
depends on ``torch`` and ``transformers`` only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    ALL_ATTENTION_FUNCTIONS,
    Qwen3Attention,
    Qwen3ForCausalLM,
    Qwen3Model,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

SOURCE_MODES = ("anchored", "relative")
MIX_RULES = ("softmax", "uniform")


class DepthMixQwen3Config(Qwen3Config):
    """Qwen3 plus Depth-Attention's options (``depth_attn_*``)."""

    model_type = "depthmix_qwen3"

    def __init__(self, depth_attn_stride: int = 1, depth_attn_source_mode: str = "anchored",
                 depth_attn_mix_rule: str = "softmax", **kwargs):
        if depth_attn_source_mode not in SOURCE_MODES:
            raise ValueError(f"depth_attn_source_mode={depth_attn_source_mode!r} must be one "
                             f"of {SOURCE_MODES}")
        if depth_attn_mix_rule not in MIX_RULES:
            raise ValueError(f"depth_attn_mix_rule={depth_attn_mix_rule!r} must be one of "
                             f"{MIX_RULES}")
        self.depth_attn_stride = depth_attn_stride
        self.depth_attn_source_mode = depth_attn_source_mode
        self.depth_attn_mix_rule = depth_attn_mix_rule
        super().__init__(**kwargs)


def depth_sources(layer: int, stride: int, mode: str) -> tuple:
    if mode == "anchored":
        return tuple(range(0, layer, stride))
    return tuple(range(layer - stride, -1, -stride))[::-1]


class DepthMixQwen3Attention(Qwen3Attention):
    """Qwen3 attention with the depth step between RoPE and the KV cache."""

    def __init__(self, config: DepthMixQwen3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.sources = depth_sources(layer_idx, config.depth_attn_stride,
                                     config.depth_attn_source_mode)
        self.mix_rule = config.depth_attn_mix_rule
        self.depth_state: dict = {}
        """This forward's ``(k_j, ṽ_j)`` by layer; shared by all layers, set by the model."""

    def depth_mix(self, query, key, value):
        """``query [b, np, s, hd]``, ``key/value [b, ng, s, hd]`` -> mixed value."""
        srcs = [self.depth_state[j] for j in self.sources]
        keys = [k for k, _ in srcs] + [key]
        values = [v for _, v in srcs] + [value]
        b, np_, s, hd = query.shape
        ng = key.shape[1]
        acc = torch.promote_types(value.dtype, torch.float32)
        if self.mix_rule == "softmax":
            q_bar = query.to(acc).view(b, ng, np_ // ng, s, hd).mean(dim=2)  # [b, ng, s, hd]
            scores = torch.stack([(q_bar * k.to(acc)).sum(-1) for k in keys], -1)
            weights = torch.softmax(scores / math.sqrt(hd), dim=-1)  # [b, ng, s, S + 1]
        else:
            weights = torch.full((b, ng, s, len(keys)), 1.0 / len(keys), dtype=acc,
                                 device=value.device)
        mixed = sum(weights[..., n, None] * v.to(acc) for n, v in enumerate(values))
        return mixed.to(value.dtype)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None,
                past_key_values=None, **kwargs):
        # transformers >= 5.24 passes the KV cache as ``cache``, earlier ones as ``past_key_values``
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if self.sources:
            value_states = self.depth_mix(query_states, key_states, value_states)
        self.depth_state[self.layer_idx] = (key_states, value_states)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class DepthMixQwen3Model(Qwen3Model):
    config_class = DepthMixQwen3Config

    def __init__(self, config: DepthMixQwen3Config):
        super().__init__(config)
        self.depth_state: dict = {}
        for i, layer in enumerate(self.layers):
            layer.self_attn = DepthMixQwen3Attention(config, i)  # same parameters, same names
            layer.self_attn.depth_state = self.depth_state
        self.post_init()

    def forward(self, *args, **kwargs):
        self.depth_state.clear()
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.depth_state.clear()


class DepthMixQwen3ForCausalLM(Qwen3ForCausalLM):
    config_class = DepthMixQwen3Config

    def __init__(self, config: DepthMixQwen3Config):
        super().__init__(config)
        self.model = DepthMixQwen3Model(config)
        self.post_init()
