"""``mixer=moda`` without its model code: options, depth-source geometry, plan and cost.

The method (MoDA, mixture-of-depths attention) and its Megatron modules are described in
:mod:`depthmix.mixers.moda.model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, Dict, List, Optional, Tuple

from depthmix.mixers.base import ExtraParams, Mixer, MixerConfig, OpCall, SavedActivations
from depthmix.mixers.base import Variant
from depthmix.mixers.base import LOOPED, model_hook, plan_state_per_token, residual_stream_entry
from depthmix.config.schema import ConfigError
from depthmix.planning.depth_plan import HIDDEN, Entry

ATTN, MLP = "attn", "mlp"
KERNELS = ("split", "fused")
"""``mixer.moda_kernel`` values (``depthmix.kernels.moda_attention.KERNELS``)."""


@dataclass
class MoDAConfig(MixerConfig):
    """``mixer=moda`` options (``configs/mixer/moda.yaml``)."""

    CHOICES: ClassVar[Dict[str, Tuple[str, ...]]] = {**MixerConfig.CHOICES,
                                                     "moda_kernel": KERNELS}

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
    moda_kernel: str = "split"
    """The Triton path (``mixer.impl=triton``): ``split`` (the sequence part through SDPA's
    cuDNN / flash attention, the depth part through a small Triton kernel, merged exactly
    by their log-sum-exps) or ``fused`` (one flash-style Triton kernel for both). The same
    result; ignored with ``mixer.impl=torch``."""

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
        # what the modules look up at every call, by plain keys (no Source built a call)
        self._stored_names = {(s.layer, s.kind): s.entry_names() for s in self.sources
                              if self._readers[s]}
        self._visible_names = [
            (tuple(s.entry_names()[0] for s in v), tuple(s.entry_names()[1] for s in v))
            for v in self._visible]

    @classmethod
    def from_config(cls, config) -> "MoDAGeometry":
        m = config.mixer
        return _geometry(config.num_layers, config.n_loops, m.ffn_kv_proj, m.depth_window)

    def visible(self, layer: int) -> Tuple[Source, ...]:
        """Depth entries layer ``layer``'s attention reads, oldest first."""
        return self._visible[layer]

    def visible_names(self, layer: int) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        """The key and the value entry names of :meth:`visible`."""
        return self._visible_names[layer]

    def stored_names(self, layer: int, kind: str) -> Optional[Tuple[str, str]]:
        """The key and value entry names of source ``(layer, kind)`` when it is stored
        (:meth:`stored`), else None."""
        return self._stored_names.get((layer, kind))

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


def view_entries(config, tp: int) -> Dict[str, float]:
    """Values are views (keys are QK-normalised copies): a reused attention value
    (``attn_kv_proj=false``) of the layer's fused QKV output ``(H + 2 H_kv) d_h``, a
    projected value of its projection's ``k|v`` output ``2 H_kv d_h`` (per TP rank)."""
    geo = MoDAGeometry.from_config(config)
    dh, kv = config.kv_channels, config.num_query_groups / tp
    qkv = config.num_attention_heads / tp * dh + 2 * kv * dh
    out = {}
    for s in geo.stored_sources():
        value = s.entry_names()[1]
        out[value] = 2 * kv * dh if _projects(config, s.kind) else qkv
    return out


def saved_activations(config, tp: int, micro_batch: int) -> SavedActivations:
    """Layer ``l`` reading ``D_l`` depth entries runs the joint sequence+depth attention in
    place of SDPA (local ``H``/``H_kv`` heads): its scores over ``s + D_l`` keys
    ``H (s + D_l)``, the depth keys and values with the sequence ones ``2 H_kv d_h (D_l +
    1)``, depth logits ``2 H_kv D_l``, less SDPA's log-sum-exp ``H``, and the causal mask
    (``s^2`` bytes a micro-batch, counted here as fp32-sized elements ``s / 4b``: the
    tests run fp32). Each projected entry (written by layer ``p``) saves the projection's
    input ``h / t``, its ``k|v`` output, normalised key and 1/rms ``3 H_kv d_h + H_kv`` and
    RoPE tables ``2 s d_h / (b s)``."""
    geo = MoDAGeometry.from_config(config)
    s, dh = config.seq_length, config.kv_channels
    heads, kv = config.num_attention_heads / tp, config.num_query_groups / tp
    t = tp if config.sequence_parallel else 1
    layers: dict = {}
    for u in range(geo.unrolled):
        d = len(geo.visible(u))
        if d:
            layers[u] = (heads * (s + d) + 2 * kv * dh * (d + 1) + 2 * kv * d - heads
                         + s / (4 * micro_batch))
    for source in geo.stored_sources():
        if _projects(config, source.kind):
            layers[source.layer] = layers.get(source.layer, 0.0) + (
                config.hidden_size / t + 3 * kv * dh + kv + 2 * dh / micro_batch)
    return SavedActivations(layers=layers)


def step_work(config, tokens: int) -> List[OpCall]:
    """Per layer, ``moda_attention`` with the ``D_l`` depth entries it reads less the same
    kernel with none (the plain causal attention vanilla runs), then one ``h x 2 H_kv d_h``
    GEMM per projected depth entry."""
    geo = MoDAGeometry.from_config(config)
    heads, ng, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    calls = [OpCall("moda depth entries", f"layer {u}", "moda_attention.depth_work",
                    (tokens, heads, heads // ng, d, len(geo.visible(u))))
             for u in range(geo.unrolled) if geo.visible(u)]
    calls += [OpCall("moda kv projection", str(s.name), "gemm",
                     (tokens, config.hidden_size, 2 * ng * d))
              for s in geo.stored_sources() if _projects(config, s.kind)]
    return calls


MIXER = Mixer(
    name="moda", config_cls=MoDAConfig, plan=moda_plan,
    model_spec=model_hook(__name__, "get_moda_model_spec"), kernels=("moda_attention",),
    extra_flops_per_token=extra_flops_per_token, extra_io_per_token=extra_io_per_token,
    extra_state_per_token=extra_state_per_token, extra_params=extra_params,
    saved_activations=saved_activations, view_entries=view_entries, step_work=step_work,
    variants=(
        Variant(prefill=1, checks=("decode", "recompute", "transport", "accounting", "generate",
                                   "kernels")),
        Variant("attn_kv-w3-post", {"attn_kv_proj": True, "depth_window": 3},
                model={"norm_position": "post"}, prefill=5, checks=("decode", "recompute")),
        Variant("no_ffn_kv-mha", {"ffn_kv_proj": False}, model={"num_query_groups": 4},
                prefill=1, checks=("decode",)),
        Variant("w2-post-mha", {"depth_window": 2},
                model={"norm_position": "post", "num_query_groups": 4}, checks=("decode",)),
        Variant("w3", {"depth_window": 3}, checks=("transport",)),
        Variant("attn_kv", {"attn_kv_proj": True}, checks=("accounting",)),
        Variant("no_ffn_kv-w2", {"ffn_kv_proj": False, "depth_window": 2}, checks=("accounting",)),
        Variant("attn_kv-w3-swa2-looped", {"attn_kv_proj": True, "depth_window": 3,
                                            "short_swa_window": 2},
                model=LOOPED, checks=("accounting",)),
        Variant("attn_kv-w3", {"attn_kv_proj": True, "depth_window": 3}, checks=("parity",)),
    ))
