"""What every mixer provides: a config dataclass, a depth plan, cost hooks and a model spec.

Everything here, and every mixer folder's ``__init__.py``, imports without torch or
Megatron (the dry run and ``--help`` use it); the model code is the folder's ``model.py``,
imported when a model is built (:func:`model_hook`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Tuple

from depthmix.config.schema import ConfigError
from depthmix.config.validate import check_choice
from depthmix.kernels.modes import IMPLS
from depthmix.planning.depth_plan import HIDDEN, STEM, Entry


@dataclass
class MixerConfig:
    """Options shared by every mixer (``configs/mixer/<name>.yaml`` extends these)."""

    CHOICES: ClassVar[Dict[str, Tuple[str, ...]]] = {"impl": IMPLS}
    """Allowed values of this config's string options (checked by :meth:`validate`)."""

    name: str = "vanilla"
    """The method (set by ``mixer=<name>``)."""
    impl: str = "auto"
    """Kernel choice: ``torch``, ``triton`` or ``auto`` (Triton when CUDA and Triton are
    usable). Resolved once at start-up and logged; never switched mid-run."""
    short_swa_window: int = 0
    """Sequence-axis ShortSWA sublayer before attention with this window (0 = off)."""

    def resolve(self, model) -> None:
        """Fill defaults that depend on the model preset (e.g. a stride)."""

    def validate(self, model, parallel) -> None:
        """Raise :class:`ConfigError` naming the option if this mixer cannot run."""
        for option, allowed in self.CHOICES.items():
            check_choice(f"mixer.{option}", getattr(self, option), allowed)
        self.check_at_least("short_swa_window", 0)

    def check_at_least(self, option: str, low) -> None:
        """Raise :class:`ConfigError` unless ``mixer.<option>`` is null or ``>= low``."""
        value = getattr(self, option)
        if value is not None and value < low:
            raise ConfigError(f"mixer.{option}={value} must be >= {low}")

    def check_pre_norm(self, model) -> None:
        """Raise :class:`ConfigError` unless the blocks are pre-norm (a method that replaces
        the residual stream reads the un-normalised state)."""
        if model.norm_position != "pre":
            raise ConfigError(f"mixer={self.name} needs pre-norm blocks (model.norm_position="
                              f"{model.norm_position!r}; set model.norm_position=pre)")


@dataclass(frozen=True)
class ExtraParams:
    """Parameters a mixer adds to the vanilla model (on one TP rank, see ``Mixer.extra_params``)."""

    layers: Tuple[int, ...] = ()
    """One count per *stored* layer (``config.num_layers`` of them, 0-based; the pipeline
    layout puts stored layer ``i`` on its stage; a looped model's stored layer holds what
    all its loops use). Empty: no per-layer parameters."""
    stem: int = 0
    """Next to the embedding (the first pipeline stage)."""
    head: int = 0
    """Next to the final norm and output layer (the last pipeline stage)."""

    def layer(self, i: int) -> int:
        return self.layers[i] if self.layers else 0

    @property
    def total(self) -> int:
        return sum(self.layers) + self.stem + self.head


NO_EXTRA_PARAMS = ExtraParams()


@dataclass(frozen=True)
class SavedActivations:
    """What a mixer saves for backward beyond the vanilla layer, in elements per token of
    one micro-batch on one TP rank (activation dtype)."""

    layers: Dict[int, float] = field(default_factory=dict)
    """Per unrolled layer index."""
    head: float = 0.0
    """Next to the final norm and output layer."""


NO_SAVED = SavedActivations()


@dataclass(frozen=True)
class OpCall:
    """One op call a mixer adds to the vanilla training step, for the roofline's step floor
    (``depthmix.bench.roofline.step_extra_floor``), which counts it forward and backward."""

    label: str
    """Its row in the step floor: the calls of one label are summed (``depth_mix``,
    ``mhc read``)."""
    case: str
    """Which call: ``layer 3``, ``sublayer 5``, ``head``."""
    counter: str
    """What counts its bytes and FLOPs: ``<op>.<function>``, a function of the kernel op's
    benchmark module ``depthmix/bench/<op>.py`` (``depth_mix.work``), or ``gemm`` /
    ``elementwise`` (``depthmix.bench.roofline``)."""
    args: Tuple = ()
    """The counter's shape arguments."""


CHECKS = ("decode", "recompute", "transport", "accounting", "generate", "parity", "kernels")
"""The shared test matrices a :class:`Variant` can run in:

* ``decode``, ``recompute``: ``tests/mixers/test_conformance.py`` (incremental decoding
  equals the full forward; full recomputation gives the same gradients);
* ``transport``: ``tests/megatron_ext/test_transport.py`` (the pipeline transport, at 8
  layers: options that give the mixer its depth state there);
* ``accounting``: ``tests/planning/test_accounting.py`` (parameters and FLOPs against the model);
* ``generate``: ``tests/inference/test_generate.py`` (batched generation);
* ``parity``: ``tests/parallel/test_parity.py`` (every parallel layout against one rank);
* ``kernels``: ``tests/kernels/test_dispatch.py`` (only a mixer with ``kernels``: options
  under which it runs them).

The memory-model and overheads tests run every mixer at its defaults."""


SUMMED = 1e-12
"""``Variant.recompute_rtol`` where recomputation sums a gradient in another order (fp64)."""
LOOPED = {"num_layers": 2, "n_loops": 2}
"""``Variant.model`` of a looped model: two stored layers, run twice."""


@dataclass(frozen=True)
class Variant:
    """An option set the shared test matrices run a mixer at (:data:`CHECKS`)."""

    name: str = ""
    """Suffix of the test id, ``<mixer>-<name>`` (empty: the mixer's name alone)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """``mixer.<option>`` values."""
    model: Mapping[str, Any] = field(default_factory=dict)
    """``model.<field>`` values on the tests' tiny model (``num_layers``, ``n_loops``,
    ``norm_position``, ``num_query_groups``)."""
    checks: Tuple[str, ...] = CHECKS
    """The matrices that run it."""
    prefill: int = 3
    """``decode``: tokens prefilled before the one-token steps."""
    recompute_rtol: float = 0.0
    """``recompute``: norm-wise tolerance of the gradients, 0 for identical; above 0 where
    a depth entry read by several sublayers of a checkpointed layer has its gradient summed
    in another order."""

    def id_for(self, mixer: str) -> str:
        return f"{mixer}-{self.name}" if self.name else mixer


@dataclass(frozen=True, kw_only=True)
class Mixer:
    """A registered depth-mixing method (``MIXER`` or ``MIXERS`` of a mixer folder).

    ``config_cls``, ``model_spec`` and ``plan`` are required: the registry refuses a
    folder whose mixer lacks one, naming it."""

    name: str
    config_cls: Optional[type] = None
    """The options: a :class:`MixerConfig` subclass (or :class:`MixerConfig` itself)."""
    model_spec: Optional[Callable] = None
    """``(DepthMixConfig) -> DepthMixModelSubmodules``; give it with :func:`model_hook`."""
    plan: Optional[Callable] = None
    """``(DepthMixConfig, tp_size) -> list[Entry]``: the depth state over unrolled layers."""
    extra_flops_per_token: Callable = lambda config: 0.0
    """``(DepthMixConfig) -> float``: *forward* FLOPs per token the method adds to the
    vanilla decoder, summed over the whole model (all unrolled layers, the stem and the
    head); 2 FLOPs per multiply-add. Counts matmul-like work: projections, depth scores,
    weighted sums over depth sources and per-token coefficient projections (also where
    the reference code writes them elementwise); norms, softmaxes, activations and plain
    residual adds are left out, as the vanilla formula leaves out its own. ShortSWA
    (``mixer.short_swa_window``) is *not* included: the accounting adds it once, for every
    mixer. Each hook documents its closed form. Training accounting counts 3x (forward +
    backward); see ``depthmix.planning.flops``. Used for the logged TFLOP/s and MFU."""
    extra_io_per_token: Callable = lambda config: 0.0
    """``(DepthMixConfig) -> float``: activation *elements* the method reads and writes per
    token in a forward pass beyond the vanilla decoder, whole model (the counting of the
    Depth-Attention paper's Appendix B: reads of depth sources and writes of what the method
    produces, less the vanilla residual traffic it replaces; bytes = elements x activation
    size). Each hook documents its closed form."""
    extra_state_per_token: Optional[Callable] = None
    """``(DepthMixConfig) -> float``: elements per token the method holds beyond the vanilla
    KV cache and residual stream while a context is prefilled (the paper's "extra prefill
    memory"). None: derived from the plan (:func:`plan_state_per_token`: the most depth
    state live across a layer boundary, less the one residual stream), which is right for
    hidden-state methods; attention-side methods whose entries are KV-cache slots override
    it."""
    extra_params: Callable = lambda config, tp=1: NO_EXTRA_PARAMS
    """``(DepthMixConfig, tp) -> ExtraParams``: parameters the method adds to the vanilla
    model, as one tensor-parallel rank of ``tp`` holds them (TP-sharded ones divided by
    ``tp``, replicated ones whole; ``tp = 1`` is the whole model), per stored layer and
    on the stem/head. ShortSWA is not included (the accounting adds it). Used for the
    parameter count and the dry run's per-stage memory estimate."""
    saved_activations: Callable = lambda config, tp, micro_batch: NO_SAVED
    """``(DepthMixConfig, tp, micro_batch) -> SavedActivations``: elements per token the
    method's own autograd graph saves for backward beyond the vanilla layer (its depth
    state as its ops save it, coefficients, stacks, norms), per unrolled layer and at the
    head, on one TP rank (hidden-side tensors divided by ``tp`` under sequence
    parallelism). Each hook documents its closed form; ``depthmix.planning.memory`` adds
    it to the vanilla layer and tests/planning/test_memory_model.py checks it against
    measurement."""
    view_entries: Callable = lambda config, tp: {}
    """``(DepthMixConfig, tp) -> {name: elements per token}``: depth-state entries that are
    views of a larger tensor (a reused value inside its layer's fused QKV output), with
    that tensor's size on one TP rank: under full recomputation the checkpoint keeps the
    whole tensor alive, which the memory model counts."""
    bind: Optional[Callable] = None
    """``(DepthMixModel) -> None``, called once on every built model chunk: for mixers
    whose modules need each other (AttnRes' two-phase inference reads a whole block's
    pseudo-queries at once). None: nothing to bind. Give it with :func:`model_hook` so
    the model code is imported only when a model is built."""
    step_work: Callable = lambda config, tokens: ()
    """``(DepthMixConfig, tokens) -> [OpCall]``: every op call the method adds to the
    vanilla training step, for a micro-batch of ``tokens`` tokens at the model's shapes
    (bf16 activations), in the order they run. Empty: nothing beyond vanilla. The roofline
    turns them into its step floor, the least time they can add on a GPU (what
    ``tools/gpu_bench.py`` sets beside each mixer's measured step)."""
    kernels: Tuple[str, ...] = ()
    """The kernel ops (``depthmix/kernels/<op>/``) its modules pick with
    ``dispatch.select``."""
    variants: Tuple[Variant, ...] = (Variant(),)
    """The option sets the shared test matrices run it at; together they cover every
    check of :data:`CHECKS` (the registry says which one is missing)."""

    def state_per_token(self, config) -> float:
        """``extra_state_per_token``, or the plan-derived default."""
        if self.extra_state_per_token is not None:
            return float(self.extra_state_per_token(config))
        return float(plan_state_per_token(config, self.plan(config, 1)))


def model_hook(package: str, function: str) -> Callable:
    """A hook that calls ``<package>.model.<function>``, importing the mixer's Megatron
    modules only when a model is built (``package``: the mixer folder's ``__name__``)."""

    def hook(*args):
        return getattr(importlib.import_module(f"{package}.model"), function)(*args)

    hook.__qualname__ = f"{package}.model.{function}"
    hook.module = f"{package}.model"
    return hook


def residual_stream_entry(config) -> Entry:
    """The vanilla residual stream ``h``: written by the stem and every layer."""
    n = config.unrolled_layers
    return Entry(HIDDEN, writers=(STEM, *range(n)), readers=(*range(n), n),
                 shape=(config.hidden_size,), seq_sharded=True)


def residual_plan(config, tp: int) -> List[Entry]:
    return [residual_stream_entry(config)]


def plan_state_per_token(config, plan_entries) -> int:
    """Elements per token of the most depth state live across any layer boundary (one
    TP rank of one, the whole hidden), less the vanilla residual stream's ``hidden_size``."""
    from math import prod

    from depthmix.planning.depth_plan import DepthPlan

    plan = DepthPlan(plan_entries, config.unrolled_layers)
    most = max(sum(prod(e.shape) for e in plan.live_at(b))
               for b in range(config.unrolled_layers + 1))
    return most - config.hidden_size
