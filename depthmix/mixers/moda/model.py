"""MoDA, mixture-of-depths attention (Zhu et al., "Mixture-of-Depths Attention").

Each query head attends, under one softmax, to the causal sequence KV of its layer and to
the *depth KV*: the KV entries at the query's own token position written by earlier
sublayers. The depth entries ("sources"), in the order they are written:

    attn0, mlp0, attn1, mlp1, ...        (mlp<u> only with ``ffn_kv_proj``)

* ``attn<u>``: the ``(k, v)`` of the attention of unrolled layer ``u``: the layer's own
  sequence keys/values (reused, no parameters), or with ``attn_kv_proj`` a separate
  projection of the attention input;
* ``mlp<u>``: a light KV projection of the MLP input of layer ``u`` (``ffn_kv_proj``).

Layer ``l``'s attention reads the sources written before it (``attn<j>``/``mlp<j>`` for
``j < l``), or only the most recent ``depth_window`` of them. A source nobody reads is
neither computed nor stored, and a module whose source is never read has no projection
(e.g. the last layer's MLP: the paper's parameter counts match ``L - 1`` projections).

Conventions (see ``docs/methods/moda.md``):

* Every depth key is treated like a sequence key: per-head RMSNorm (QK-norm, when the
  model has it) then RoPE at its own token position. A depth entry of position ``t`` is
  only ever read by the query of position ``t``, which is rotated by the same angle, so
  depth scores equal the un-rotated ``q_t . k_t``: they do not depend on the absolute
  position. Reused attention entries are exactly the layer's (normed, rotated) keys.
* Depth values are raw projections (no norm, no RoPE), like sequence values.

Parallelism: depth mixing is per KV head, hence TP-local. Depth entries are
attention-side state (full sequence, the rank's ``ng/tp`` KV heads); the projections are
``ColumnParallelLinear`` sharded by KV head, and under sequence parallelism they gather
their ``[s/tp, b, h]`` input like ``linear_qkv``. Under pipeline parallelism the live
depth entries (at most ``depth_window``) travel with the activations; see :func:`moda_plan`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from depthmix.mixers.moda import ATTN, MLP, MoDAGeometry
from depthmix.kernels.dispatch import select
from depthmix.kernels.moda_attention import moda_attention_reference, moda_depth_weights
from depthmix.megatron_ext.attention import DepthMixSelfAttention, SDPACoreAttention, causal_sdpa
from depthmix.megatron_ext.context import ForwardContext
from depthmix.megatron_ext.rope import apply_rope
from depthmix.planning.depth_plan import DepthState
from depthmix.megatron_ext.layer import StateHook
from depthmix.megatron_ext.model import seeded_init
from depthmix.megatron_ext.norm import QKNorm
from depthmix.megatron_ext.specs import (
    get_attention_spec,
    get_decoder_layer_submodules,
    get_model_submodules,
)


# ---------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------


class DepthKVProjection(MegatronModule):
    """A light ``(k, v)`` projection of a sublayer input onto the KV heads.

    ``x [s(/tp), b, h]`` -> ``k, v [s, b, ng/tp, hn]``; the output columns are laid out
    per KV group ``[ng, (k, v), hn]`` so the column split gives each TP rank its own
    groups' keys and values. The key goes through the same per-head RMSNorm (when the
    model has QK-norm; named ``k_layernorm`` so Megatron all-reduces its TP grads) and
    RoPE as sequence keys. Weights are drawn from their own seed, so the model's other
    weights are the same as vanilla's at the same seed.
    """

    def __init__(self, config, layer_number: int, kind: str):
        super().__init__(config=config)
        self.head_dim = config.kv_channels
        ng = config.num_query_groups
        with seeded_init(config.init_seed + 1000 * layer_number + (500 if kind == ATTN else 501)):
            self.linear_kv = ColumnParallelLinear(
                config.hidden_size, 2 * ng * self.head_dim, config=config,
                init_method=config.init_method, bias=False, gather_output=False,
                skip_bias_add=False,
                # one rank: no gradient to reduce, so no identity autograd Function in front
                disable_grad_reduce=parallel_state.get_tensor_model_parallel_world_size() == 1,
            )
        self.k_layernorm = (QKNorm(config, self.head_dim, eps=config.layernorm_epsilon)
                            if config.qk_layernorm else None)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tuple[Tensor, Tensor]:
        kv, _ = self.linear_kv(x)  # [s, b, ng/tp * 2 * hn]
        kv = kv.view(*kv.shape[:2], -1, 2, self.head_dim)  # [s, b, ng/tp, 2, hn]
        key, value = kv.unbind(3)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if ctx.rotary_pos_emb is not None:
            key = apply_rope(key, ctx, self.config)
        return key, value


def _write(state: DepthState, names: Tuple[str, str], key: Tensor, value: Tensor) -> None:
    state[names[0]], state[names[1]] = key, value


class _GrowDepthKV(torch.autograd.Function):
    """A layer's depth keys and values ``[s, b, ng, D, hn]`` from the previous reader's
    (``prefix``, ``D'`` entries) and the entries written since (``new``: keys, then as many
    values): ``cat(prefix, stack(new))``, each way.

    Stacking every entry anew at every layer costs autograd one ``select`` per entry and
    reader backward, and one ``add`` per entry and extra reader to sum an entry's gradient
    over the layers that read it: O(depth) calls a layer. Grown from the previous reader's
    tensor, the readers' gradients are summed on the stacks instead, one ``add`` a layer,
    and each entry's gradient leaves its stack once (two view ops here, each way). The
    sums are the same additions in the same order: bit for bit the per-entry stacks'."""

    @staticmethod
    def forward(ctx, k_prefix, v_prefix, *new):
        n = len(new) // 2
        ctx.sizes = (k_prefix.shape[3], n)
        return (torch.cat((k_prefix, torch.stack(new[:n], dim=3)), dim=3),
                torch.cat((v_prefix, torch.stack(new[n:], dim=3)), dim=3))

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        k_prefix, k_new = grad_k.split(ctx.sizes, dim=3)
        v_prefix, v_new = grad_v.split(ctx.sizes, dim=3)
        return (k_prefix, v_prefix, *k_new.unbind(3), *v_new.unbind(3))


_STACKS = "moda/depth_kv"
"""``ctx.extras`` key of the last reader's ``(key names, key entries, value entries, depth
keys, depth values)`` in this forward (eager only)."""


def depth_kv(state: DepthState, names: Tuple[Tuple[str, ...], Tuple[str, ...]],
             ctx: ForwardContext) -> Tuple[Tensor, Tensor]:
    """The ``[s, b, ng, D, hn]`` depth keys and values of the entries ``names`` (key names,
    value names), oldest first: grown from the previous reader's stacks in this forward
    (:class:`_GrowDepthKV`) where those stacked this forward's entries and ``names``
    continues theirs, else stacked. Compiled layers stack (Inductor fuses the stacks; the
    cache would be state outside the graph)."""
    k_names, v_names = names
    if torch.compiler.is_compiling():
        return (torch.stack([state[n] for n in k_names], dim=3),
                torch.stack([state[n] for n in v_names], dim=3))
    previous = ctx.extras.get(_STACKS)
    grown = None if previous is None else _grow(previous, state, k_names, v_names)
    if grown is None:
        keys, values = tuple(state[n] for n in k_names), tuple(state[n] for n in v_names)
        grown = keys, values, torch.stack(keys, dim=3), torch.stack(values, dim=3)
    ctx.extras[_STACKS] = (k_names, *grown)
    return grown[2], grown[3]


def _grow(previous, state: DepthState, k_names, v_names):
    """``(keys, values, depth keys, depth values)`` grown from ``previous``, or None."""
    old_names, old_keys, old_values, k_stack, v_stack = previous
    try:  # the window may have dropped the oldest entries: the previous names' tail is ours' head
        drop = old_names.index(k_names[0])
    except ValueError:
        return None
    kept = len(old_names) - drop
    if kept >= len(k_names) or old_names[drop:] != k_names[:kept]:
        return None
    # entries are written once per forward, so the newest kept entry being the stacked
    # tensor means they all are (a recomputed layer's inputs are new tensors)
    if (state[k_names[kept - 1]] is not old_keys[-1]
            or state[v_names[kept - 1]] is not old_values[-1]):
        return None
    new_keys = tuple([state[n] for n in k_names[kept:]])
    new_values = tuple([state[n] for n in v_names[kept:]])
    if drop:
        k_stack, v_stack = k_stack.narrow(3, drop, kept), v_stack.narrow(3, drop, kept)
    if GROW_FUNCTION:
        k, v = _GrowDepthKV.apply(k_stack, v_stack, *new_keys, *new_values)
    else:
        k = torch.cat((k_stack, torch.stack(new_keys, dim=3)), dim=3)
        v = torch.cat((v_stack, torch.stack(new_values, dim=3)), dim=3)
    return old_keys[drop:] + new_keys, old_values[drop:] + new_values, k, v


GROW_FUNCTION = True


class MoDADepthMixer(MegatronModule):
    """``self_attention.depth_mixer``: writes the layer's attention depth entry, stacks
    the entries it reads into ``[s, b, ng, D, hn]`` and hands them to the core attention."""

    def __init__(self, config, layer_number: int = 1, num_query_groups: int = 1,
                 num_attention_heads: int = 1, **kwargs):
        super().__init__(config=config)
        self.geo = MoDAGeometry.from_config(config)
        self.num_sources = 2 * self.geo.unrolled
        self.reads_own_projection = config.mixer.attn_kv_proj
        unique = layer_number - 1
        self.proj = (
            DepthKVProjection(config, layer_number, ATTN)
            if config.mixer.attn_kv_proj and self.geo.has_projection(unique, ATTN) else None
        )

    def project_input(self, hidden_states: Tensor, state: DepthState, ctx: ForwardContext):
        """``attn_kv_proj``: the attention input's own depth projection (called by
        :class:`MoDASelfAttention` before the q/k/v projection)."""
        if self.proj is not None:
            names = self.geo.stored_names(ctx.layer, ATTN)
            if names is not None:
                _write(state, names, *self.proj(hidden_states, ctx))

    def forward(self, query, key, value, state: DepthState, ctx: ForwardContext):
        if not self.reads_own_projection:
            names = self.geo.stored_names(ctx.layer, ATTN)
            if names is not None:
                _write(state, names, key, value)  # reused: the layer's normed, rotated keys
        sources = self.geo.visible(ctx.layer)
        if not sources:
            if ctx.stats is not None:
                self._record(ctx, sources, None)
            return key, value, {}
        depth_key, depth_value = depth_kv(state, self.geo.visible_names(ctx.layer), ctx)
        kwargs = {"depth_key": depth_key, "depth_value": depth_value}
        if ctx.stats is not None:
            kwargs["depth_stats"] = lambda weights: self._record(ctx, sources, weights)
        return key, value, kwargs

    def _record(self, ctx: ForwardContext, sources, weights: Optional[Tensor]) -> None:
        """Share of attention mass on depth vs sequence, and the mean weight of each
        source (a ``2 * L`` vector: ``2u`` attention, ``2u + 1`` MLP of layer ``u``)."""
        per_source = torch.zeros(self.num_sources)
        depth_mass = torch.zeros(())
        if weights is not None:  # [sq, b, np, D]
            mean = weights.mean(dim=(0, 1, 2)).cpu()
            per_source[[s.stat_index for s in sources]] = mean
            depth_mass = mean.sum()
        ctx.record("moda_depth_mass", depth_mass)
        ctx.record("moda_seq_mass", 1.0 - depth_mass)
        ctx.record("moda_source_weights", per_source)


class MoDASelfAttention(DepthMixSelfAttention):
    """Self-attention that also hands its input to the depth mixer (``attn_kv_proj``)."""

    def forward(self, hidden_states: Tensor, state: DepthState, ctx: ForwardContext):
        self.depth_mixer.project_input(hidden_states, state, ctx)
        return super().forward(hidden_states, state, ctx)


class MoDACoreAttention(SDPACoreAttention):
    """Core attention over the causal sequence KV and the depth KV under one softmax
    (``kernels.moda_attention``: with ``mixer.impl=triton`` the split path, SDPA's attention
    plus a Triton depth kernel, or with ``mixer.moda_kernel=fused`` the fused Triton
    kernel; the PyTorch reference with ``torch``); plain SDPA where a layer has no depth
    entries. A padding mask (left-padded batched generation) takes the reference, which
    accepts one; the Triton paths implement the causal rule only."""

    def __init__(self, config, layer_number: int, **kwargs):
        super().__init__(config, layer_number, **kwargs)
        self.moda_attention = select("moda_attention", config.mixer.impl)
        if config.mixer.impl == "triton" and config.mixer.moda_kernel == "fused":
            from depthmix.kernels.moda_attention import moda_attention_fused

            self.moda_attention = moda_attention_fused

    def forward(self, query, key, value, attention_mask=None, depth_key=None,
                depth_value=None, depth_stats=None, **kwargs):
        if depth_key is None:
            return causal_sdpa(query, key, value, self.softmax_scale, mask=attention_mask)
        if depth_stats is not None:
            depth_stats(moda_depth_weights(query, key, depth_key,
                                           softmax_scale=self.softmax_scale))
        if attention_mask is not None:
            return moda_attention_reference(query, key, value, depth_key, depth_value,
                                            softmax_scale=self.softmax_scale,
                                            attention_mask=attention_mask)
        return self.moda_attention(query, key, value, depth_key, depth_value,
                                   softmax_scale=self.softmax_scale)


class MoDAMLPDepthKV(StateHook):
    """``mlp_depth_kv``: the MLP's depth entry, a KV projection of its (normed) input."""

    def __init__(self, config, layer_number: int = 1, **kwargs):
        super().__init__(config=config)
        self.geo = MoDAGeometry.from_config(config)
        self.proj = (DepthKVProjection(config, layer_number, MLP)
                     if self.geo.has_projection(layer_number - 1, MLP) else None)

    def forward(self, state: DepthState, ctx: ForwardContext, mlp_input: Tensor) -> None:
        if self.proj is not None:
            names = self.geo.stored_names(ctx.layer, MLP)
            if names is not None:
                _write(state, names, *self.proj(mlp_input, ctx))


def get_moda_model_spec(config):
    layer = get_decoder_layer_submodules(config)
    attention = get_attention_spec(config, depth_mixer=MoDADepthMixer,
                                   core_attention=MoDACoreAttention)
    layer = replace(
        layer,
        self_attention=ModuleSpec(module=MoDASelfAttention, submodules=attention.submodules),
        mlp_depth_kv=MoDAMLPDepthKV if config.mixer.ffn_kv_proj else StateHook,
    )
    return get_model_submodules(config, layer)
