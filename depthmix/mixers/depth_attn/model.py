"""Depth-Attention ("Depth-Attention: Cross-Layer Value Mixing for Language Models"): attention
along depth inside the attention module.

Before layer ``l`` attends over the sequence, its query attends over the keys of ``l`` and
of its source layers ``S(l)`` *at the same token position* and mixes their values into the
value that sequence attention then reads::

    q̄_l  = mean of the G query heads of each KV group               [s, b, ng, hn]
    a     = softmax_{j in S(l) + [l]}( q̄_l · k_j / sqrt(hn) )   (fp32)
    ṽ_l  = a_l v_l + sum_{j in S(l)} a_j ṽ_j                       (sources: mixed values)
    out   = causal_attention(q_l, k_l, ṽ_l)

No parameters, no new persistent state: ``ṽ_l`` goes to the V-cache slot (the attention
module caches whatever keys/values its ``depth_mixer`` returns). The depth state carries
the source layers' ``(k_j, ṽ_j)`` — attention-side tensors at the rank's local KV heads,
full sequence — from the writing layer to its last reader, so under pipeline parallelism
only those cross stages. The math lives in :func:`depthmix.kernels.depth_mix.depth_mix_reference`,
the contract of the fused kernel ``depth_mix_triton``.

Sources index the *unrolled* layer sequence (``ctx.layer``). In a looped transformer
(``model.n_loops > 1``) a layer's own earlier-loop values are added to its sources
(``mixer.own_loops``, default true, the paper's looped Depth-Attention); the stride's
sources over the unrolled depth stay as they are.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.module import MegatronModule

from depthmix.mixers.depth_attn import DepthSchedule, key_name, value_name
from depthmix.kernels.depth_mix import depth_weights
from depthmix.kernels.dispatch import select
from depthmix.megatron_ext.context import ForwardContext
from depthmix.planning.depth_plan import DepthState
from depthmix.megatron_ext.specs import (
    get_attention_spec,
    get_decoder_layer_submodules,
    get_model_submodules,
)


# ---- the attention's depth_mixer slot ------------------------------------------------------
class DepthAttention(MegatronModule):
    """``depth_mixer`` of :class:`~depthmix.megatron_ext.attention.DepthMixSelfAttention`.

    Called after QK-norm and RoPE with ``q [s, b, np, hn]``, ``k/v [s, b, ng, hn]`` on the
    rank's local heads (TP-local: each rank mixes its own KV heads, no communication).

    RoPE invariance: every depth score pairs a query and a key of the *same* token position
    ``t``, and RoPE rotates both by the same orthogonal ``R_t`` (per head, per 2-d plane), so
    ``(R_t q̄)·(R_t k) = q̄·R_tᵀR_t k = q̄·k``: the scores are the same before or after RoPE
    (the group mean commutes with ``R_t`` too, being linear). We therefore score here, after
    RoPE, with the very keys sequence attention reads; no unrotated copies are kept. In the
    key-mixing modes a convex combination of keys rotated by the same ``R_t`` is the rotation
    of the combination, so mixed keys are correctly positioned for sequence attention.
    """

    def __init__(self, config, layer_number: int = 1, num_query_groups: int = 1,
                 num_attention_heads: int = 1, **kwargs):
        super().__init__(config=config)
        cfg = config.mixer
        self.schedule = DepthSchedule.from_config(config)
        self.mix_rule, self.mixed_state = cfg.mix_rule, cfg.mixed_state
        self.carries_keys, self.carries_values = cfg.carries_keys, cfg.mixes_values
        self.depth_mix = select("depth_mix", cfg.impl)

    def forward(self, query, key, value, state: DepthState, ctx: ForwardContext):
        layer = ctx.layer  # unrolled index: a looped layer has different sources per loop
        sources = self.schedule.sources(layer)
        src_keys = [state[key_name(j)] for j in sources] if self.carries_keys else None
        src_values = [state[value_name(j)] for j in sources] if self.carries_values else None
        key_out, value_out = self.depth_mix(query, key, value, src_keys, src_values,
                                            mix_rule=self.mix_rule, mixed_state=self.mixed_state)
        if self.schedule.readers(layer):
            # what later layers read: the raw key (scores, key mixing), the mixed value
            if self.carries_keys:
                state[key_name(layer)] = key
            if self.carries_values:
                state[value_name(layer)] = value_out
        if ctx.stats is not None:
            weights = depth_weights(query, key, src_keys, num_sources=len(sources),
                                    mix_rule=self.mix_rule)  # [s, b, ng, S + 1]
            ctx.record("depth_attn/weights", weights.mean(dim=(0, 1, 2)))
            ctx.record("depth_attn/sources", torch.tensor([*sources, layer]))
        return key_out, value_out, {}


# ---- spec -----------------------------------------------------------------------------
def get_depth_attn_model_spec(config):
    layer = get_decoder_layer_submodules(config)
    layer = dataclasses.replace(layer, self_attention=get_attention_spec(
        config, depth_mixer=DepthAttention))
    return get_model_submodules(config, layer)
