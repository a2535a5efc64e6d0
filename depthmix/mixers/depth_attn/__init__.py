"""``mixer=depth_attn`` without its model code: options, source schedule, plan and cost.

The method (Depth-Attention, attention along depth inside the attention module) and its
Megatron module are described in :mod:`depthmix.mixers.depth_attn.model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Tuple

from depthmix.mixers.base import LOOPED, SUMMED, Mixer, MixerConfig, OpCall, Variant, model_hook
from depthmix.mixers.base import residual_stream_entry
from depthmix.mixers.base import SavedActivations
from depthmix.config.schema import ConfigError
from depthmix.kernels.modes import MIX_RULES, MIXED_STATES
from depthmix.planning.depth_plan import Entry


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

    CHOICES: ClassVar[Dict[str, Tuple[str, ...]]] = {
        **MixerConfig.CHOICES, "source_mode": SOURCE_MODES, "mix_rule": MIX_RULES,
        "mixed_state": MIXED_STATES}

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
        self.check_at_least("stride", 1)
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

    The Depth-Attention paper's appendix B.2 counting (a multiply-add is 2 FLOPs; dot products and
    weighted
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


def view_entries(config, tp: int) -> Dict[str, float]:
    """A source layer that mixes nothing itself passes its own value on: ``ṽ_j`` is a view
    of its fused QKV output, ``(H + 2 H_kv) d_h / tp`` a token."""
    if not config.mixer.mixes_values:
        return {}
    schedule = DepthSchedule.from_config(config)
    qkv = (config.num_attention_heads + 2 * config.num_query_groups) * config.kv_channels / tp
    return {value_name(j): qkv for j in schedule.source_layers if not schedule.sources(j)}


def saved_activations(config, tp: int, micro_batch: int) -> SavedActivations:
    """Per layer ``l`` that mixes over depth sources ``S_l`` (one TP rank, ``H_kv`` local
    KV heads): the stacked depth keys and values ``2 H_kv d_h`` and the depth logits with
    the layer's own ``H_kv (|S_l| + 1)``."""
    schedule = DepthSchedule.from_config(config)
    kv, dh = config.num_query_groups / tp, config.kv_channels
    return SavedActivations(layers={
        u: 2 * kv * dh + kv * (len(schedule.sources(u)) + 1)
        for u in range(config.unrolled_layers) if schedule.sources(u)})


def step_work(config, tokens: int) -> List[OpCall]:
    """One ``depth_mix`` per layer with ``|S(l)| > 0`` sources (softmax over the sources'
    keys, mixed values: the kernel benchmark's options)."""
    schedule = DepthSchedule.from_config(config)
    heads, d = config.num_attention_heads, config.kv_channels
    g = heads // config.num_query_groups
    return [OpCall("depth_mix", f"layer {u}", "depth_mix.work",
                   (tokens, heads, g, d, len(schedule.sources(u))))
            for u in range(config.unrolled_layers) if schedule.sources(u)]


MIXER = Mixer(
    name="depth_attn", config_cls=DepthAttnConfig, plan=depth_attn_plan,
    model_spec=model_hook(__name__, "get_depth_attn_model_spec"), kernels=("depth_mix",),
    extra_flops_per_token=extra_flops_per_token, extra_io_per_token=extra_io_per_token,
    extra_state_per_token=lambda config: 0, saved_activations=saved_activations,
    view_entries=view_entries, step_work=step_work,
    variants=(
        Variant(checks=("accounting", "generate")),
        Variant("s1", {"stride": 1}, checks=("decode", "recompute", "parity", "kernels"),
                recompute_rtol=SUMMED),
        Variant("s1-mha", {"stride": 1}, model={"num_query_groups": 4}, checks=("decode",)),
        Variant("s1-key_value", {"stride": 1, "mixed_state": "key_value"},
                checks=("decode", "recompute", "accounting"), recompute_rtol=SUMMED),
        Variant("s1-looped", {"stride": 1}, model=LOOPED, checks=("decode", "accounting")),
        Variant("s1-uniform-relative", {"stride": 1, "mix_rule": "uniform",
                                         "source_mode": "relative"}, checks=("accounting",)),
        Variant("s2", {"stride": 2}, checks=("transport",)),
        Variant("s3-key_value", {"stride": 3, "mixed_state": "key_value"}, checks=("transport",)),
    ))
