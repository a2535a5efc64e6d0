"""Sequence-axis ShortSWA (Residual Stream Duality paper, Zhang 2026; "Rethinking SWA", Zhang 2025).

A short causal sliding-window attention over the sequence, placed before the layer's
attention: ``S = H + ShortSWA(Norm(H); w)``, ``A = S + Attn(Norm(S))``. The layer's
``short_swa`` slot (``layer.py``) returns ``s = ShortSWA(Norm(x); w)`` and the attention
sublayer becomes ``y = s + attn(norm(x + s))``, which is the Residual Stream Duality paper's block
with the plain
residual and composes with every residual operator (mHC, DDL, AttnRes, ...).
``specs.get_decoder_layer_submodules`` fills the slot for every mixer when
``mixer.short_swa_window > 0``.

Contents: its own RMSNorm, then Megatron's ``SelfAttention`` parameters and TP sharding
(``linear_qkv`` column-parallel, QK-norm as the model, RoPE, ``linear_proj`` row-parallel),
at the model's head layout (heads, KV groups, head dim), with a causal window of ``w``
positions (query ``i`` sees keys ``i-w+1 .. i``). KV-cached decoding keeps the last
``w - 1`` keys/values per layer under the cache key ``("swa", layer)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from depthmix.megatron_ext.model import seeded_init
from depthmix.megatron_ext.norm import QKNorm, RMSNorm
from depthmix.megatron_ext.rope import apply_rope

SWA_SEED = 303


def sliding_window_sdpa(query: Tensor, key: Tensor, value: Tensor, window: int,
                        scale: Optional[float] = None, block: Optional[int] = None,
                        visible: Optional[Tensor] = None) -> Tensor:
    """Causal attention restricted to the last ``window`` positions.

    ``query [sq, b, np, hn]``, ``key/value [sk, b, ng, hn]`` with ``sk >= sq`` (GQA:
    ``np % ng == 0``); query ``i`` sits at position ``p = sk - sq + i`` and sees keys
    ``j`` with ``p - window < j <= p``. Returns ``[sq, b, np * hn]``. Queries are processed in
    blocks so the work is ``O(sq * (block + window))``, not ``O(sq * sk)``. ``visible``:
    an extra ``[b, 1, sq, sk]`` key mask (True = visible) anded with the window, e.g. the
    padding mask of a left-padded batch.
    """
    sq, b, np_, hn = query.shape
    sk = key.shape[0]
    block = block or max(64, window)
    q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
    k = key.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
    v = value.permute(1, 2, 0, 3)
    outs = []
    for start in range(0, sq, block):
        end = min(sq, start + block)
        p0, p1 = sk - sq + start, sk - sq + end  # query positions [p0, p1)
        k0 = max(0, p0 - window + 1)
        pos_q = torch.arange(p0, p1, device=q.device)[:, None]
        pos_k = torch.arange(k0, p1, device=q.device)[None, :]
        mask = (pos_k <= pos_q) & (pos_k > pos_q - window)  # [p1-p0, p1-k0]
        if visible is not None:
            mask = mask & visible[:, :, start:end, k0:p1]  # [b, 1, p1-p0, p1-k0]
        outs.append(F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, k0:p1], v[:, :, k0:p1], attn_mask=mask, scale=scale,
            enable_gqa=True))
    out = torch.cat(outs, dim=2)  # [b, np, sq, hn]
    return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


class SlidingWindowCoreAttention(MegatronModule):
    """Core attention of ShortSWA (the window is ``config.mixer.short_swa_window``)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type=None,
                 cp_comm_type=None, softmax_scale=None, pg_collection=None):
        super().__init__(config=config)
        self.window = config.mixer.short_swa_window
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, **kwargs):
        return sliding_window_sdpa(query, key, value, self.window, self.softmax_scale,
                                   visible=attention_mask)


class ShortSWAAttention(SelfAttention):
    """Megatron ``SelfAttention`` (same parameters and TP sharding) with a sliding-window
    core and its own KV-cache namespace."""

    def __init__(self, config, submodules: SelfAttentionSubmodules, layer_number: int,
                 pg_collection=None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=AttnMaskType.causal, pg_collection=pg_collection)
        self.window = config.mixer.short_swa_window

    def forward(self, hidden_states: Tensor, ctx) -> Tensor:
        # [s, b, h] -> q [s, b, np, hn], k/v [s, b, ng, hn] (local heads, after QK-norm)
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if ctx.rotary_pos_emb is not None:
            query = apply_rope(query, ctx, self.config)
            key = apply_rope(key, ctx, self.config)
        mask = None
        if ctx.inference is not None:  # the next token needs only the last w - 1 positions
            key, value = ctx.inference.update(("swa", ctx.layer), key, value,
                                              keep=self.window - 1)
            mask = ctx.inference.attention_mask(query.shape[0], key.shape[0])  # padding
        context = self.core_attention(query, key, value, mask)  # [s, b, np*hn]
        output, bias = self.linear_proj(context)
        assert bias is None, "depthmix layers are bias-free"
        return output


class ShortSWA(MegatronModule):
    """The layer's ``short_swa`` slot: ``x [s, b, h] -> ShortSWA(RMSNorm(x); w) [s, b, h]``."""

    def __init__(self, config, layer_number: int = 1, pg_collection=None, **kwargs):
        super().__init__(config=config)
        self.window = config.mixer.short_swa_window
        # Own seed: the layer's attention/MLP draw the same weights with or without ShortSWA.
        with seeded_init(config.init_seed + 1000 * layer_number + SWA_SEED):
            self.norm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
            self.attention = ShortSWAAttention(
                config,
                SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SlidingWindowCoreAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=QKNorm if config.qk_layernorm else None,
                    k_layernorm=QKNorm if config.qk_layernorm else None,
                ),
                layer_number=layer_number,
                pg_collection=pg_collection,
            )

    def forward(self, x: Tensor, ctx) -> Tensor:
        return self.attention(self.norm(x), ctx)


def get_short_swa_spec(config) -> ModuleSpec:
    return ModuleSpec(module=ShortSWA)
