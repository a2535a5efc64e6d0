"""Self-attention with a depth-mixing slot, and an SDPA core attention.

``DepthMixSelfAttention`` is Megatron's ``SelfAttention`` (same parameters, names and
TP sharding: ``linear_qkv``, ``q_layernorm``, ``k_layernorm``, ``linear_proj``) with a
shorter forward that exposes the point where depth mixing happens: after QK-norm and
RoPE, before sequence attention. The ``depth_mixer`` submodule may rewrite the layer's
keys/values from the depth state (Depth-Attention) or hand extra depth KV to the core
attention (MoDA). Heads are the rank's local heads, so depth mixing is TP-local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from depthmix.megatron_ext.context import ForwardContext
from depthmix.megatron_ext.rope import apply_rope
from depthmix.planning.depth_plan import DepthState


class NoDepthMixer(MegatronModule):
    """Vanilla: keys and values pass through untouched."""

    def __init__(self, config, layer_number: int = 1, **kwargs):
        super().__init__(config=config)

    def forward(self, query, key, value, state: DepthState, ctx: ForwardContext):
        return key, value, {}


@dataclass
class DepthMixAttentionSubmodules(SelfAttentionSubmodules):
    depth_mixer: Union[ModuleSpec, type] = NoDepthMixer


def _sdpa_call(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor]):
    """The arguments :func:`causal_sdpa` hands SDPA: ``q [b, np, sq, hn]``, ``k/v [b, ng, sk,
    hn]`` as strided views of the ``[s, b, heads, hn]`` inputs (the head dim stays the
    contiguous one, which is all the flash and cuDNN kernels ask of a layout; no copy), K/V
    left at their ``ng`` heads (``enable_gqa``: the kernels read each KV head for its ``G``
    query heads, nothing is repeated), the mask (None for the causal square: the
    ``is_causal`` kernels) and ``is_causal``."""
    sq, sk = query.shape[0], key.shape[0]
    q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
    k = key.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
    v = value.permute(1, 2, 0, 3)
    if mask is None and sq != sk:  # the last sq positions (incremental decoding)
        pos_q = torch.arange(sk - sq, sk, device=q.device)[:, None]
        mask = torch.arange(sk, device=q.device)[None, :] <= pos_q
    return q, k, v, mask, mask is None


def causal_sdpa(query: Tensor, key: Tensor, value: Tensor, scale: Optional[float] = None,
                mask: Optional[Tensor] = None):
    """Causal attention of the last ``sq`` positions over ``sk >= sq`` keys.

    ``query [sq, b, np, hn]``, ``key/value [sk, b, ng, hn]`` (GQA: ``np % ng == 0``).
    Returns ``[sq, b, np * hn]``. Query ``i`` sits at position ``sk - sq + i``.
    ``mask``: visible keys ``[b, 1, sq, sk]`` (True = visible, causality included) in
    place of the causal rule; a left-padded batch passes
    :meth:`~depthmix.inference.KVCache.attention_mask`.
    """
    sq, b, np_, hn = query.shape
    q, k, v, mask, is_causal = _sdpa_call(query, key, value, mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                         scale=scale, enable_gqa=True)
    return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def sdpa_backend(query: Tensor, key: Tensor, value: Tensor, scale: Optional[float] = None,
                 mask: Optional[Tensor] = None):
    """The kernel SDPA picks for :func:`causal_sdpa` on these inputs (an
    ``torch.nn.attention.SDPBackend``): ``FLASH_ATTENTION`` or ``CUDNN_ATTENTION`` is the
    fast path; ``EFFICIENT_ATTENTION`` cannot take GQA and ``MATH`` repeats K/V and
    materialises the scores. On CPU, ``FLASH_ATTENTION`` is its fused kernel."""
    from torch.nn.attention import SDPBackend

    q, k, v, mask, is_causal = _sdpa_call(query, key, value, mask)
    return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale=scale,
                                              enable_gqa=True))


class SDPACoreAttention(MegatronModule):
    """Causal core attention through ``torch.nn.functional.scaled_dot_product_attention``
    (flash / memory-efficient kernels on GPU, a fused CPU kernel otherwise)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type=None,
                 cp_comm_type=None, softmax_scale=None, pg_collection=None):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, **kwargs):
        return causal_sdpa(query, key, value, self.softmax_scale, mask=attention_mask)


class DepthMixSelfAttention(SelfAttention):
    """Megatron ``SelfAttention`` whose forward reads and writes the depth state."""

    def __init__(self, config, submodules: DepthMixAttentionSubmodules, layer_number: int,
                 pg_collection=None, **kwargs):
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=AttnMaskType.causal,
            pg_collection=pg_collection,
        )
        if config.num_query_groups % self.world_size:
            raise ValueError("num_query_groups must be divisible by the TP size")
        self.depth_mixer = build_module(
            submodules.depth_mixer,
            config=config,
            layer_number=layer_number,
            num_query_groups=self.num_query_groups_per_partition,
            num_attention_heads=self.num_attention_heads_per_partition,
        )

    def forward(self, hidden_states: Tensor, state: DepthState, ctx: ForwardContext):
        # [s, b, h] -> q [s, b, np, hn], k/v [s, b, ng, hn] (after QK-norm)
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if ctx.rotary_pos_emb is not None:
            query = apply_rope(query, ctx, self.config)
            key = apply_rope(key, ctx, self.config)
        key, value, depth_kwargs = self.depth_mixer(query, key, value, state, ctx)
        mask = None
        if ctx.inference is not None:
            key, value = ctx.inference.update(ctx.layer, key, value)
            mask = ctx.inference.attention_mask(query.shape[0], key.shape[0])  # padding
        context = self.core_attention(query, key, value, mask, **depth_kwargs)  # [s, b, np*hn]
        output, bias = self.linear_proj(context)
        assert bias is None, "depthmix layers are bias-free"
        return output
