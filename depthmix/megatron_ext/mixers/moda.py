"""MoDA, mixture-of-depths attention (seed 003).

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

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from depthmix.config.schema import ConfigError
from depthmix.kernels.dispatch import select
from depthmix.kernels.moda_attention import moda_attention_reference, moda_depth_weights
from depthmix.megatron_ext.attention import DepthMixSelfAttention, SDPACoreAttention, causal_sdpa
from depthmix.megatron_ext.context import ForwardContext
from depthmix.megatron_ext.depth_state import DepthState, Entry
from depthmix.megatron_ext.layer import HIDDEN, StateHook
from depthmix.megatron_ext.mixers.base import (
    ExtraParams,
    Mixer,
    MixerConfig,
    plan_state_per_token,
    residual_stream_entry,
)
from depthmix.megatron_ext.model import seeded_init
from depthmix.megatron_ext.norm import QKNorm
from depthmix.megatron_ext.specs import (
    get_attention_spec,
    get_decoder_layer_submodules,
    get_model_submodules,
)

ATTN, MLP = "attn", "mlp"


@dataclass
class MoDAConfig(MixerConfig):
    """``mixer=moda`` options (``configs/mixer/moda.yaml``)."""

    name: str = "moda"
    ffn_kv_proj: bool = True
    """Each MLP adds a depth entry: a light KV projection of its input (paper's default,
    variants table, row 4)."""
    attn_kv_proj: bool = False
    """Attention layers write a separately projected depth KV of their input instead of
    reusing their own sequence k/v (variants table, row 5: +parameters, marginal gain)."""
    depth_window: Optional[int] = None
    """Keep only the most recent W depth entries (the paper's slot-buffer future work,
    sliding-window policy); null = every preceding entry."""

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        for option in ("ffn_kv_proj", "attn_kv_proj"):
            if not isinstance(getattr(self, option), bool):
                raise ConfigError(f"mixer.{option}={getattr(self, option)!r} must be true or false")
        w = self.depth_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise ConfigError(f"mixer.depth_window={w!r} must be an integer >= 1 or null")
        if w is not None and w < 1:
            raise ConfigError(f"mixer.depth_window={w} must be >= 1 (or null for every "
                              "preceding depth entry; no depth entries is mixer=vanilla)")
        if model.num_layers * model.n_loops < 2:
            raise ConfigError(f"mixer=moda needs at least 2 (unrolled) layers: with "
                              f"model.num_layers={model.num_layers} and model.n_loops="
                              f"{model.n_loops} no layer has a preceding depth entry")
        if self.attn_kv_proj and self.ffn_kv_proj and w == 1:
            raise ConfigError("mixer.attn_kv_proj=true is undefined with mixer.depth_window=1 "
                              "and mixer.ffn_kv_proj=true: every layer sees only the previous "
                              "MLP's entry, so the attention depth projections would never "
                              "be read")


# ---------------------------------------------------------------------------------------
# Which layer reads which depth entry (static; the plan, the modules and tests use it)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A depth entry: the ``(k, v)`` written by one sublayer of one unrolled layer."""

    layer: int
    kind: str  # ATTN | MLP

    @property
    def name(self) -> str:
        return f"{self.kind}{self.layer}"

    @property
    def stat_index(self) -> int:
        """Column in the per-layer source-weight statistics: 2u (attn), 2u + 1 (mlp)."""
        return 2 * self.layer + (self.kind == MLP)

    def entry_names(self) -> Tuple[str, str]:
        return f"moda_k_{self.name}", f"moda_v_{self.name}"


class MoDAGeometry:
    """Depth sources, per-layer windows and readers over the unrolled layer sequence."""

    def __init__(self, num_layers: int, n_loops: int, ffn_kv_proj: bool,
                 depth_window: Optional[int]):
        self.num_layers, self.n_loops = num_layers, n_loops
        self.unrolled = num_layers * n_loops
        kinds = (ATTN, MLP) if ffn_kv_proj else (ATTN,)
        self.sources = [Source(u, k) for u in range(self.unrolled) for k in kinds]
        self._visible: List[Tuple[Source, ...]] = []
        for layer in range(self.unrolled):
            before = [s for s in self.sources if s.layer < layer]
            if depth_window is not None:
                before = before[max(0, len(before) - depth_window):]
            self._visible.append(tuple(before))
        self._readers: Dict[Source, Tuple[int, ...]] = {
            s: tuple(l for l in range(self.unrolled) if s in self._visible[l])
            for s in self.sources
        }

    @classmethod
    def from_config(cls, config) -> "MoDAGeometry":
        m = config.mixer
        return _geometry(config.num_layers, config.n_loops, m.ffn_kv_proj, m.depth_window)

    def visible(self, layer: int) -> Tuple[Source, ...]:
        """Depth entries layer ``layer``'s attention reads, oldest first."""
        return self._visible[layer]

    def readers(self, source: Source) -> Tuple[int, ...]:
        return self._readers[source]

    def stored(self, source: Source) -> bool:
        """Whether the entry is read at all (else it is never computed)."""
        return bool(self._readers[source])

    def stored_sources(self) -> List[Source]:
        return [s for s in self.sources if self.stored(s)]

    def has_projection(self, unique_layer: int, kind: str) -> bool:
        """Whether the module of ``unique_layer`` (0-based) needs a depth projection for
        ``kind``: some unrolled application of it writes a read entry."""
        return any(
            self._readers.get(Source(loop * self.num_layers + unique_layer, kind))
            for loop in range(self.n_loops)
        )


@lru_cache(maxsize=64)
def _geometry(num_layers, n_loops, ffn_kv_proj, depth_window) -> MoDAGeometry:
    return MoDAGeometry(num_layers, n_loops, ffn_kv_proj, depth_window)


def moda_plan(config, tp: int) -> List[Entry]:
    """The residual stream plus, per read depth source, its keys and values.

    Entries are attention-side (full sequence, ``[s, b, ng/tp, hn]``): written by the
    source's layer, read by exactly the layers whose window holds the source, so a
    pipeline transition into layer ``p`` carries the ``min(W, n_p)`` entries of layer
    ``p``'s window (``n_p`` = sources written before ``p``), less what the receiving rank
    cached itself under interleaving.
    """
    geo = MoDAGeometry.from_config(config)
    shape = (config.num_query_groups // tp, config.kv_channels)
    entries = [residual_stream_entry(config)]
    for source in geo.stored_sources():
        for name in source.entry_names():
            entries.append(Entry(name, writers=(source.layer,), readers=geo.readers(source),
                                 shape=shape, seq_sharded=False))
    return entries


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
            )
        self.k_layernorm = (QKNorm(config, self.head_dim, eps=config.layernorm_epsilon)
                            if config.qk_layernorm else None)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tuple[Tensor, Tensor]:
        kv, _ = self.linear_kv(x)  # [s, b, ng/tp * 2 * hn]
        kv = kv.view(*kv.shape[:2], -1, 2, self.head_dim)  # [s, b, ng/tp, 2, hn]
        key, value = kv[..., 0, :], kv[..., 1, :]
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if ctx.rotary_pos_emb is not None:
            key = apply_rotary_pos_emb(key, ctx.rotary_pos_emb, config=self.config)
        return key, value


def _write(state: DepthState, source: Source, key: Tensor, value: Tensor) -> None:
    k_name, v_name = source.entry_names()
    state[k_name], state[v_name] = key, value


class MoDADepthMixer(MegatronModule):
    """``self_attention.depth_mixer``: writes the layer's attention depth entry, stacks
    the entries it reads into ``[s, b, ng, D, hn]`` and hands them to the core attention."""

    def __init__(self, config, layer_number: int = 1, num_query_groups: int = 1,
                 num_attention_heads: int = 1, **kwargs):
        super().__init__(config=config)
        self.geo = MoDAGeometry.from_config(config)
        self.num_sources = 2 * self.geo.unrolled
        unique = layer_number - 1
        self.proj = (
            DepthKVProjection(config, layer_number, ATTN)
            if config.mixer.attn_kv_proj and self.geo.has_projection(unique, ATTN) else None
        )

    def project_input(self, hidden_states: Tensor, state: DepthState, ctx: ForwardContext):
        """``attn_kv_proj``: the attention input's own depth projection (called by
        :class:`MoDASelfAttention` before the q/k/v projection)."""
        source = Source(ctx.layer, ATTN)
        if self.proj is not None and self.geo.stored(source):
            _write(state, source, *self.proj(hidden_states, ctx))

    def forward(self, query, key, value, state: DepthState, ctx: ForwardContext):
        own = Source(ctx.layer, ATTN)
        if not self.config.mixer.attn_kv_proj and self.geo.stored(own):
            _write(state, own, key, value)  # reused: the layer's normed, rotated keys
        sources = self.geo.visible(ctx.layer)
        if not sources:
            if ctx.stats is not None:
                self._record(ctx, sources, None)
            return key, value, {}
        depth_key = torch.stack([state[s.entry_names()[0]] for s in sources], dim=3)
        depth_value = torch.stack([state[s.entry_names()[1]] for s in sources], dim=3)
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
    (``kernels.moda_attention``: the fused Triton kernel with ``mixer.impl=triton``, the
    PyTorch reference with ``torch``); plain SDPA where a layer has no depth entries.
    A padding mask (left-padded batched generation) takes the reference, which accepts
    one; the fused kernel implements the causal rule only."""

    def __init__(self, config, layer_number: int, **kwargs):
        super().__init__(config, layer_number, **kwargs)
        self.moda_attention = select("moda_attention", config.mixer.impl)

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
        source = Source(ctx.layer, MLP)
        if self.proj is not None and self.geo.stored(source):
            _write(state, source, *self.proj(mlp_input, ctx))


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


# ---------------------------------------------------------------------------------------
# Cost (the accounting's hooks)
# ---------------------------------------------------------------------------------------


def _projects(config, kind: str) -> bool:
    """Whether entries of ``kind`` come from a depth KV projection (else reused k/v)."""
    return config.mixer.ffn_kv_proj if kind == MLP else config.mixer.attn_kv_proj


def extra_flops_per_token(config) -> int:
    """Forward FLOPs per token added to a vanilla decoder (whole model; ``h`` hidden,
    ``H``/``H_kv`` query/KV heads, ``d_h`` head dim)::

        projections      4 h H_kv d_h   per *computed* projected entry: every read MLP
                                        entry (ffn_kv_proj) and, with attn_kv_proj, every
                                        read attention entry; unread ones are never built
        depth attention  4 H d_h D_l    per layer l reading D_l = |visible(l)| entries:
                                        scores q.K_dep and the weighted depth values, per
                                        query head under the shared softmax

    i.e. without a window ``(L-1)(ffn + attn) 4 h H_kv d_h + 2 (1 + ffn) H d_h L (L-1)``.
    Left out: QK-norm and RoPE of projected keys, the softmax over the ``D_l`` extra
    logits. The sequence part of the attention is the vanilla term.
    """
    geo = MoDAGeometry.from_config(config)
    h, hn = config.hidden_size, config.kv_channels
    ng, heads = config.num_query_groups, config.num_attention_heads
    projected = sum(1 for s in geo.stored_sources() if _projects(config, s.kind))
    depth = sum(len(geo.visible(layer)) for layer in range(geo.unrolled))
    return projected * 4 * h * ng * hn + depth * 4 * heads * hn


def extra_io_per_token(config) -> int:
    """Activation elements read and written per token beyond vanilla (whole model;
    ``d_kv = H_kv d_h``): each layer reads the keys and values of its ``D_l`` visible depth
    entries (``2 D_l d_kv``) and every computed projection writes one entry (``2 d_kv``)::

        2 d_kv (sum_l D_l + projected entries)

    Reused attention entries are the layer's own sequence keys/values, written anyway."""
    geo = MoDAGeometry.from_config(config)
    d_kv = config.num_query_groups * config.kv_channels
    projected = sum(1 for s in geo.stored_sources() if _projects(config, s.kind))
    depth = sum(len(geo.visible(layer)) for layer in range(geo.unrolled))
    return 2 * d_kv * (depth + projected)


def extra_state_per_token(config) -> int:
    """Elements per token held beyond vanilla while prefilling: the *projected* depth
    entries (keys and values, ``2 d_kv`` each) live across a layer boundary at most at once;
    reused attention entries are KV-cache slots (0 extra). From the plan, restricted to them."""
    geo = MoDAGeometry.from_config(config)
    names = {n for s in geo.stored_sources() if _projects(config, s.kind) for n in s.entry_names()}
    entries = moda_plan(config, 1)
    kept = [e for e in entries if e.name in names or e.name == HIDDEN]
    return plan_state_per_token(config, kept)


def extra_params(config, tp: int = 1) -> ExtraParams:
    """Per stored layer, each depth KV projection it owns (one whose entry some unrolled
    application writes and a later layer reads, see :meth:`MoDAGeometry.has_projection`):
    ``linear_kv`` ``h x 2 H_kv d_h`` (column-parallel: ``/ tp``) plus the depth keys'
    QK-norm gain ``d_h`` (replicated, with ``qk_layernorm``). Reused attention entries
    add nothing; so ``ffn_kv_proj`` alone costs ``(L - 1)`` projections at ``n_loops = 1``."""
    geo = MoDAGeometry.from_config(config)
    hn = config.kv_channels
    proj = (config.hidden_size * 2 * config.num_query_groups * hn // tp
            + (hn if config.qk_layernorm else 0))
    return ExtraParams(layers=tuple(
        proj * sum(1 for kind in (ATTN, MLP)
                   if _projects(config, kind) and geo.has_projection(u, kind))
        for u in range(config.num_layers)))


MIXER = Mixer(name="moda", config_cls=MoDAConfig, model_spec=get_moda_model_spec,
              plan=moda_plan, extra_flops_per_token=extra_flops_per_token,
              extra_io_per_token=extra_io_per_token, extra_state_per_token=extra_state_per_token,
              extra_params=extra_params)
