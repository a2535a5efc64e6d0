"""depthmix's Qwen3 for Hugging Face (remote code shipped with a depthmix export):
Depth-Attention and mixture-of-experts MLPs on Hugging Face's Qwen3.

**Depth-Attention** (the Depth-Attention paper, eqs. 2-3, GQA as in its section 3.3;
``depth_attn: true``) adds no parameters: the weights are Qwen3's. Inside attention layer
``l``, after QK-norm and RoPE and before sequence attention, at every token position and per
KV group::

    q̄   = mean of the group's G query heads
    a_j  = softmax_j( q̄ · k_j / sqrt(head_dim) ),  j in S(l) ∪ {l}  (fp32; uniform: 1/(|S|+1))
    ṽ_l = a_l v_l + Σ_{j in S(l)} a_j ṽ_j           (sources contribute their mixed values)

and sequence attention runs on ``(q_l, k_l, ṽ_l)``; ``ṽ_l`` is what the KV cache stores.
Sources ``S(l)``: ``anchored`` ``{j < l : j % stride == 0}``, ``relative`` ``{l - stride,
l - 2 stride, ...}``. Same-position scores are RoPE-invariant, so scoring after RoPE is
exact. Only ``mixed_state=value`` is implemented here.

**Experts** (``num_experts > 0``) replace the MLP on Qwen3-MoE's layers (``decoder_sparse_step``,
``mlp_only_layers``). Per token ``x``, in fp32, with router weight ``W`` and ``s = Wx``::

    softmax (Switch Transformer, GShard, Qwen3-MoE): p = softmax(s); the top-k of p;
        weights p_i, renormalised over the k when norm_topk_prob
    sigmoid (DeepSeek-V3): p = sigmoid(s); the top-k of p + b (the expert bias, for the
        choice only); weights p_i renormalised over the k (k > 1)
    y = moe_routed_scaling_factor * Σ_{i in top-k} w_i E_i(x)  +  S(x)

with ``E_i`` and the shared expert ``S`` (``moe_shared_expert_intermediate_size``) SwiGLU
MLPs. Every token reaches its experts (no capacity).

Load with ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``. This file
depends on ``torch`` and ``transformers`` only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
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
SCORE_FUNCTIONS = ("softmax", "sigmoid")


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {allowed}")


class DepthMixQwen3Config(Qwen3Config):
    """Qwen3 plus Depth-Attention's options (``depth_attn``, ``depth_attn_*``) and experts
    (Qwen3-MoE's fields plus ``moe_*``)."""

    model_type = "depthmix_qwen3"

    def __init__(self, depth_attn: bool = True, depth_attn_stride: int = 1,
                 depth_attn_source_mode: str = "anchored", depth_attn_mix_rule: str = "softmax",
                 num_experts: int = 0, num_experts_per_tok: int = 2,
                 moe_intermediate_size: int = 0, norm_topk_prob: bool = True,
                 decoder_sparse_step: int = 1, mlp_only_layers: Optional[list] = None,
                 moe_score_function: str = "softmax", moe_expert_bias: bool = False,
                 moe_routed_scaling_factor: Optional[float] = None,
                 moe_shared_expert_intermediate_size: int = 0, **kwargs):
        _one_of("depth_attn_source_mode", depth_attn_source_mode, SOURCE_MODES)
        _one_of("depth_attn_mix_rule", depth_attn_mix_rule, MIX_RULES)
        _one_of("moe_score_function", moe_score_function, SCORE_FUNCTIONS)
        self.depth_attn = depth_attn
        self.depth_attn_stride = depth_attn_stride
        self.depth_attn_source_mode = depth_attn_source_mode
        self.depth_attn_mix_rule = depth_attn_mix_rule
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.decoder_sparse_step = decoder_sparse_step
        self.mlp_only_layers = list(mlp_only_layers or [])
        self.moe_score_function = moe_score_function
        self.moe_expert_bias = moe_expert_bias
        self.moe_routed_scaling_factor = moe_routed_scaling_factor
        self.moe_shared_expert_intermediate_size = moe_shared_expert_intermediate_size
        super().__init__(**kwargs)

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


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


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    """Scores, the top-k choice and the k weights of each token (fp32)."""

    def __init__(self, config: DepthMixQwen3Config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.score_function = config.moe_score_function
        self.normalize = config.norm_topk_prob and self.top_k > 1
        self.scale = config.moe_routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.moe_expert_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x):
        """``x [T, d]`` -> weights ``[T, k]`` (fp32), experts ``[T, k]``."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.softmax(-1) if self.score_function == "softmax" else logits.sigmoid()
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.scale is not None:
            weights = weights * self.scale
        return weights, experts


class MoEBlock(nn.Module):
    """The routed experts (and the shared expert) of one layer."""

    def __init__(self, config: DepthMixQwen3Config):
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = nn.ModuleList(SwiGLU(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        shared = config.moe_shared_expert_intermediate_size
        self.shared_expert = SwiGLU(config.hidden_size, shared) if shared else None

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, d]
        weights, experts = self.gate(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tokens, slot = torch.where(experts == e)
            if tokens.numel():
                y = expert(x[tokens]) * weights[tokens, slot, None].to(x.dtype)
                out.index_add_(0, tokens, y)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view_as(hidden_states)


class DepthMixQwen3Model(Qwen3Model):
    config_class = DepthMixQwen3Config

    def __init__(self, config: DepthMixQwen3Config):
        super().__init__(config)
        self.depth_state: dict = {}
        for i, layer in enumerate(self.layers):
            if config.depth_attn:  # same parameters, same names
                layer.self_attn = DepthMixQwen3Attention(config, i)
                layer.self_attn.depth_state = self.depth_state
            if config.is_moe_layer(i):
                layer.mlp = MoEBlock(config)
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
