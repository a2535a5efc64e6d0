"""Depth-Attention (seed 000): attention along depth inside the attention module.

Before layer ``l`` attends over the sequence, its query attends over the keys of ``l`` and
of its source layers ``S(l)`` *at the same token position* and mixes their values into the
value that sequence attention then reads (SPEC section 1.1)::

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
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core.transformer.module import MegatronModule

from depthmix.config.schema import ConfigError
from depthmix.kernels.depth_mix import MIX_RULES, MIXED_STATES, depth_weights
from depthmix.kernels.dispatch import select
from depthmix.megatron_ext.context import ForwardContext
from depthmix.megatron_ext.depth_state import DepthState, Entry
from depthmix.megatron_ext.mixers.base import Mixer, MixerConfig, residual_stream_entry
from depthmix.megatron_ext.specs import (
    get_attention_spec,
    get_decoder_layer_submodules,
    get_model_submodules,
)

SOURCE_MODES = ("anchored", "relative")


# ---- which layers feed which --------------------------------------------------------------
def default_stride(unrolled_layers: int) -> int:
    """Half the (unrolled) depth: the paper's default (section 3.3, figure 4)."""
    return max(1, unrolled_layers // 2)


def depth_sources(layer: int, stride: int, mode: str = "anchored",
                  loop_period: Optional[int] = None) -> Tuple[int, ...]:
    """``S(layer)``, ascending. ``anchored``: ``{j < l : j % s == 0}`` (``s >= L`` is "first
    layer only", ``s = 1`` every earlier layer); ``relative``: ``{l-s, l-2s, ...} ∩ [0, l)``.
    ``loop_period = N`` (a looped stack of ``N`` stored layers): also the layer's own
    earlier-loop runs ``{l-N, l-2N, ...}`` (the looped Depth-Attention of the paper)."""
    if mode == "anchored":
        sources = set(range(0, layer, stride))
    elif mode == "relative":
        sources = set(range(layer - stride, -1, -stride))
    else:
        raise ValueError(f"source_mode={mode!r} must be one of {SOURCE_MODES}")
    if loop_period:
        sources |= set(range(layer - loop_period, -1, -loop_period))
    return tuple(sorted(sources))


class DepthSchedule:
    """Sources and readers of every layer of an unrolled stack of ``num_layers``."""

    def __init__(self, num_layers: int, stride: int, mode: str = "anchored",
                 loop_period: Optional[int] = None):
        self.num_layers, self.stride, self.mode = num_layers, stride, mode
        self._sources = [depth_sources(u, stride, mode, loop_period) for u in range(num_layers)]
        readers: Dict[int, List[int]] = {}
        for u, sources in enumerate(self._sources):
            for j in sources:
                readers.setdefault(j, []).append(u)
        self._readers = {j: tuple(r) for j, r in readers.items()}

    @classmethod
    def from_config(cls, config) -> "DepthSchedule":
        cfg = config.mixer
        stride = cfg.stride if cfg.stride is not None else default_stride(config.unrolled_layers)
        looped = cfg.own_loops and config.unrolled_layers > config.num_layers
        return cls(config.unrolled_layers, stride, cfg.source_mode,
                   loop_period=config.num_layers if looped else None)

    def sources(self, layer: int) -> Tuple[int, ...]:
        return self._sources[layer]

    def readers(self, layer: int) -> Tuple[int, ...]:
        """Later layers that read ``layer`` (empty: it is nobody's source)."""
        return self._readers.get(layer, ())

    @property
    def source_layers(self) -> Tuple[int, ...]:
        """Layers some later layer reads, ascending."""
        return tuple(sorted(self._readers))


# ---- config --------------------------------------------------------------------------------
@dataclass
class DepthAttnConfig(MixerConfig):
    """``mixer=depth_attn`` (``configs/mixer/depth_attn.yaml``)."""

    name: str = "depth_attn"
    stride: Optional[int] = None
    """Source stride ``s``; None = half the unrolled depth (``model.num_layers *
    model.n_loops / 2``: 12 for 360m/500m, 16 for 710m, 24 for 1p5b/3b), set by
    :meth:`resolve`."""
    source_mode: str = "anchored"
    """``anchored``: ``S(l) = {j < l : j % s == 0}``; ``relative``: ``{l-s, l-2s, ...}``."""
    mix_rule: str = "softmax"
    """``softmax`` of ``q̄·k / sqrt(d_h)`` (the paper), or ``uniform`` (plain mean over
    ``{l} ∪ S(l)``; the paper's ablation, table 5)."""
    own_loops: bool = True
    """Looped models (``model.n_loops > 1``): a layer also reads the values it produced at
    its own earlier loops, as the paper's looped Depth-Attention defines them ("the value
    states it produced at earlier loop steps serve as additional depth sources", Section
    4.4). False: only the stride's sources over the unrolled depth."""
    mixed_state: str = "value"
    """What the weights mix (table 6): ``value`` (default), ``key`` or ``key_value``. In the
    key modes the sources contribute their raw keys ``k_j`` (see ``docs/methods/depth_attn.md``)."""

    def resolve(self, model) -> None:
        if self.stride is None:
            self.stride = default_stride(model.num_layers * model.n_loops)

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        depth = model.num_layers * model.n_loops
        if self.stride is not None and self.stride < 1:
            raise ConfigError(f"mixer.stride={self.stride} must be >= 1")
        if self.source_mode not in SOURCE_MODES:
            raise ConfigError(f"mixer.source_mode={self.source_mode!r} must be one of "
                              f"{SOURCE_MODES}")
        if self.mix_rule not in MIX_RULES:
            raise ConfigError(f"mixer.mix_rule={self.mix_rule!r} must be one of {MIX_RULES}")
        if self.mixed_state not in MIXED_STATES:
            raise ConfigError(f"mixer.mixed_state={self.mixed_state!r} must be one of "
                              f"{MIXED_STATES}")
        stride = self.stride if self.stride is not None else default_stride(depth)
        looped = self.own_loops and model.n_loops > 1
        if not DepthSchedule(depth, stride, self.source_mode,
                             model.num_layers if looped else None).source_layers:
            # every layer would mix over itself only: silently the vanilla model
            raise ConfigError(
                f"mixer.stride={stride} with mixer.source_mode={self.source_mode} gives no "
                f"layer a depth source at unrolled depth {depth} (model.num_layers * "
                f"model.n_loops); use mixer.stride < {depth} and at least 2 layers")

    @property
    def mixes_keys(self) -> bool:
        return self.mixed_state in ("key", "key_value")

    @property
    def mixes_values(self) -> bool:
        return self.mixed_state in ("value", "key_value")

    @property
    def carries_keys(self) -> bool:
        """Sources' keys are needed: for the softmax scores or as the mixed quantity."""
        return self.mix_rule == "softmax" or self.mixes_keys


def key_name(layer: int) -> str:
    return f"depth_attn/k{layer}"


def value_name(layer: int) -> str:
    return f"depth_attn/v{layer}"


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


# ---- spec, plan, cost ----------------------------------------------------------------------
def get_depth_attn_model_spec(config):
    layer = get_decoder_layer_submodules(config)
    layer = dataclasses.replace(layer, self_attention=get_attention_spec(
        config, depth_mixer=DepthAttention))
    return get_model_submodules(config, layer)


def depth_attn_plan(config, tp: int) -> List[Entry]:
    """The residual stream plus, per source layer ``j``, its key ``k_j`` and mixed value
    ``ṽ_j`` (only those the options need), written by ``j`` and read by the layers that
    mix over ``j``. Attention-side: full sequence, ``(num_query_groups / tp, head_dim)``."""
    cfg = config.mixer
    schedule = DepthSchedule.from_config(config)
    shape = (config.num_query_groups // tp, config.kv_channels)
    entries = [residual_stream_entry(config)]
    for j in schedule.source_layers:
        readers = schedule.readers(j)
        if cfg.carries_keys:
            entries.append(Entry(key_name(j), writers=(j,), readers=readers, shape=shape,
                                 seq_sharded=False))
        if cfg.mixes_values:
            entries.append(Entry(value_name(j), writers=(j,), readers=readers, shape=shape,
                                 seq_sharded=False))
    return entries


def extra_flops_per_token(config) -> int:
    """Forward FLOPs per token added to a vanilla decoder (whole model, all heads).

    Seed 000 appendix B.2's counting (a multiply-add is 2 FLOPs; dot products and weighted
    sums only, the softmax over a handful of entries omitted), per layer ``l`` with
    ``n_l = |S(l)| > 0`` sources and ``d_kv = ng * hn``: the scores ``2 (n_l + 1) d_kv``
    (softmax rule only), each mixed tensor ``2 (n_l + 1) d_kv``, and the group mean of the
    queries ``np * hn`` (GQA only). Layers without sources cost nothing. Depth-Attention
    adds no parameters (``extra_params`` is the default: none).
    """
    cfg = config.mixer
    schedule = DepthSchedule.from_config(config)
    ng, hn, heads = config.num_query_groups, config.kv_channels, config.num_attention_heads
    d_kv = ng * hn
    mixed = int(cfg.mixes_keys) + int(cfg.mixes_values)
    total = 0
    for u in range(schedule.num_layers):
        n = len(schedule.sources(u))
        if n == 0:
            continue
        if cfg.mix_rule == "softmax":
            total += 2 * (n + 1) * d_kv + (heads * hn if heads > ng else 0)
        total += mixed * 2 * (n + 1) * d_kv
    return total


def extra_io_per_token(config) -> int:
    """Activation elements read and written per token beyond vanilla (whole model): per
    layer ``l`` with ``n_l = |S(l)| > 0`` sources and ``d_kv = ng * hn``, the source keys
    (softmax rule or key mixing) and source values (value mixing) read, and the mixed
    tensors written, ``(n_l (c_k + c_v) + m_k + m_v) d_kv`` -- the paper's Appendix B.2
    ``(2 n_l + 1) d_kv`` for its value mixing. Nothing is kept: the mixed value takes the
    value's KV-cache slot, so the extra prefill state is 0."""
    cfg = config.mixer
    schedule = DepthSchedule.from_config(config)
    d_kv = config.num_query_groups * config.kv_channels
    per_source = int(cfg.carries_keys) + int(cfg.mixes_values)
    written = int(cfg.mixes_keys) + int(cfg.mixes_values)
    return sum((len(schedule.sources(u)) * per_source + written) * d_kv
               for u in range(config.unrolled_layers) if schedule.sources(u))


MIXER = Mixer(name="depth_attn", config_cls=DepthAttnConfig,
              model_spec=get_depth_attn_model_spec, plan=depth_attn_plan,
              extra_flops_per_token=extra_flops_per_token,
              extra_io_per_token=extra_io_per_token, extra_state_per_token=lambda config: 0)
