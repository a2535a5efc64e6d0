"""``mixer=attnres_full`` / ``attnres_block`` without their model code: options, the
sublayer geometry, plan and cost.

The method (Attention Residuals, Full and Block) and its Megatron modules are described
in :mod:`depthmix.mixers.attnres.model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

from depthmix.mixers.base import SUMMED, ExtraParams, Mixer, MixerConfig, SavedActivations
from depthmix.mixers.base import LOOPED, OpCall, Variant, model_hook
from depthmix.config.schema import ConfigError
from depthmix.planning.depth_plan import STEM, DepthState, Entry

if TYPE_CHECKING:
    from torch import Tensor


# ---------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------


def _check_pre_norm(model) -> None:
    if model.norm_position != "pre":
        raise ConfigError(
            f"model.norm_position={model.norm_position!r}: Attention Residuals replace the "
            "residual sum and need pre-norm sublayers (the paper's 'In Norm'); use 'pre'"
        )


@dataclass
class AttnResConfig(MixerConfig):
    """Full Attention Residuals: every sublayer attends over all earlier outputs."""

    name: str = "attnres_full"

    @property
    def sublayers_per_block(self) -> int:
        return 1

    @property
    def uses_two_phase(self) -> bool:
        return False

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        _check_pre_norm(model)


@dataclass
class BlockAttnResConfig(MixerConfig):
    """Block Attention Residuals: attention over block sums and the current partial sum."""

    name: str = "attnres_block"
    num_blocks: int = 8
    """Blocks of sublayers (the embedding's block 0 not counted): the block size is
    ``ceil(N / num_blocks)`` for ``N = 2 * num_layers * n_loops`` sublayers, the last block
    taking what is left. The Attention Residuals paper stores about eight block
    representations ("eight stored block representations"); ``num_blocks = N`` is Full
    AttnRes."""
    block_size: Optional[int] = None
    """Sublayers per block (attention and MLP count separately), set explicitly instead of
    ``num_blocks`` (it wins when both are set). A ``block_size`` that does not divide ``N``
    leaves a shorter last block."""
    two_phase: bool = True
    """Inference through a KV cache (prefill and decode) reads the completed blocks once
    per block for all its sublayers (phase 1, one batched matmul) and merges each
    sublayer's partial-sum term by online softmax (phase 2), the paper's two-phase
    inference. Same result as the per-sublayer reads; false = per-sublayer reads. Training
    and cache-free forwards always use the per-sublayer reads."""

    @property
    def sublayers_per_block(self) -> int:
        assert self.block_size is not None, "resolve() derives block_size from num_blocks"
        return self.block_size

    def resolve(self, model) -> None:
        if self.block_size is None and self.num_blocks >= 1:
            sublayers = 2 * model.num_layers * model.n_loops
            self.block_size = max(1, -(-sublayers // self.num_blocks))

    @property
    def uses_two_phase(self) -> bool:
        return self.two_phase

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        _check_pre_norm(model)
        self.check_at_least("num_blocks", 1)
        self.check_at_least("block_size", 1)
        sublayers = 2 * model.num_layers * model.n_loops
        if self.block_size is not None and self.block_size > sublayers:
            raise ConfigError(
                f"mixer.block_size={self.block_size} is larger than the number of sublayers "
                f"2 * model.num_layers * model.n_loops = {sublayers} (one block would hold "
                "them all: no depth attention left); use mixer.num_blocks instead"
            )


# ---------------------------------------------------------------------------------------
# Which entries a sublayer reads and writes
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnResGeometry:
    """Sources and writes of every sublayer; ``block_size = 1`` is Full AttnRes.

    Sublayers are 1-based, ``num_sublayers + 1`` is the head. Blocks hold ``block_size``
    consecutive sublayers; when that does not divide ``num_sublayers`` the last block is
    shorter (ragged) and completes at the last sublayer, so the head always reads completed
    blocks only. Entry names: completed blocks ``b{k}`` (``y{s}`` for Full, where block
    ``s`` is sublayer ``s``), the running partial sum of block ``k`` ``p{k}``.
    """

    num_sublayers: int
    block_size: int = 1

    @classmethod
    def from_config(cls, config) -> "AttnResGeometry":
        return cls(2 * config.unrolled_layers, config.mixer.sublayers_per_block)

    @property
    def head(self) -> int:
        return self.num_sublayers + 1

    @property
    def num_blocks(self) -> int:
        """Blocks of sublayers (the embedding's block 0 not counted)."""
        return -(-self.num_sublayers // self.block_size)

    def block_name(self, k: int) -> str:
        return f"y{k}" if self.block_size == 1 else f"b{k}"

    @staticmethod
    def partial_name(k: int) -> str:
        return f"p{k}"

    def block_of(self, i: int) -> int:
        """Block of sublayer ``i >= 1`` (the head opens block ``num_blocks + 1``)."""
        if i == self.head:
            return self.num_blocks + 1
        return (i - 1) // self.block_size + 1

    def position_in_block(self, i: int) -> int:
        return 0 if i == self.head else (i - 1) % self.block_size

    def block_range(self, k: int) -> range:
        """The sublayers of block ``k >= 1``."""
        first = (k - 1) * self.block_size + 1
        return range(first, min(first + self.block_size, self.num_sublayers + 1))

    @staticmethod
    def layer_of(i: int) -> int:
        """Unrolled layer running sublayer ``i`` (the head maps to ``num_layers``)."""
        return (i - 1) // 2

    @staticmethod
    def sublayer(layer: int, which: str) -> int:
        return 2 * layer + (1 if which == "attn" else 2)

    def sources(self, i: int) -> List[str]:
        """Entries sublayer ``i`` attends over: completed blocks, then the partial sum."""
        k = self.block_of(i)
        names = [self.block_name(j) for j in range(k)]
        if self.position_in_block(i) > 0:
            names.append(self.partial_name(k))
        return names

    def write(self, state: DepthState, i: int, output: Tensor) -> None:
        """Add sublayer ``i``'s output to its block; a full block becomes ``b{k}``."""
        k, pos = self.block_of(i), self.position_in_block(i)
        total = output if pos == 0 else state.pop(self.partial_name(k)) + output
        if i == self.block_range(k)[-1]:
            state[self.block_name(k)] = total
        else:
            state[self.partial_name(k)] = total

    def source_reads(self, two_phase: bool) -> Tuple[int, int]:
        """Depth-source vectors (of ``d``) one token reads in one forward, over every
        sublayer and the head: ``(all reads, reads of completed blocks)``. Per-sublayer
        reads: sublayer ``i`` of block ``k`` reads ``k`` completed blocks (+ the partial sum
        unless first in its block). Two-phase: each block's ``k`` completed blocks once for
        the whole block (phase 1), then one partial sum per later sublayer (phase 2)."""
        partial = sum(1 for i in range(1, self.head) if self.position_in_block(i) > 0)
        if two_phase:
            blocks = sum(self.block_of(i) for i in range(1, self.head)
                         if self.position_in_block(i) == 0)
        else:
            blocks = sum(self.block_of(i) for i in range(1, self.head))
        blocks += self.block_of(self.head)  # the head reads every block once either way
        return blocks + partial, blocks

    def entries(self, hidden_size: int) -> List[Entry]:
        """The plan: exact writer and reader layers of every entry.

        A read by the layer that wrote the entry happens inside that layer and is not
        listed (the plan only describes layer boundaries).
        """
        out = []
        for k in range(self.num_blocks + 1):
            last = self.block_range(k)[-1] if k else 0  # the sublayer completing block k
            writer = STEM if k == 0 else self.layer_of(last)
            readers = sorted({self.layer_of(i) for i in range(last + 1, self.head + 1)} - {writer})
            out.append(Entry(self.block_name(k), (writer,), tuple(readers), (hidden_size,)))
        if self.block_size > 1:
            for k in range(1, self.num_blocks + 1):
                block = self.block_range(k)
                writers = sorted({self.layer_of(i) for i in block[:-1]})
                readers = sorted({self.layer_of(i) for i in block[1:]} - set(writers[:1]))
                if readers:  # else written and read inside one layer only
                    out.append(Entry(self.partial_name(k), tuple(writers), tuple(readers),
                                     (hidden_size,)))
        return out


def attnres_plan(config, tp: int) -> List[Entry]:
    return AttnResGeometry.from_config(config).entries(config.hidden_size)


def extra_flops_per_token(config) -> int:
    """Forward FLOPs per token added to a vanilla decoder (whole model, ``d`` hidden)::

        sum over the N + 1 reads i (every sublayer, then the head) of 4 d S_i

    with ``S_i = len(sources(i))``: the logits ``w . RMSNorm(v_s)`` (``2d`` per source) and
    the weighted sum of the sources (``2d`` per source). Full: ``S_i = i``, so
    ``2d (N + 1)(N + 2)``; Block (``m`` per block): ``S_i`` = completed blocks plus the
    partial sum when ``i`` is not first in its block. Left out: the key RMSNorm (``~4d``
    per source in the reference, ``O(d)`` per source with a shared-RMS kernel), the
    softmax, and the block partial sums' adds (the residual adds AttnRes replaces).
    """
    geo = AttnResGeometry.from_config(config)
    return 4 * config.hidden_size * sum(len(geo.sources(i)) for i in range(1, geo.head + 1))


def extra_io_per_token(config) -> int:
    """Activation elements read and written per token beyond vanilla (whole model, ``d``
    hidden): every read ``i`` (each sublayer, then the head) reads its ``S_i`` sources and
    writes the aggregate, ``(S_i + 1) d``; Block AttnRes's partial-sum adds (every sublayer
    but a block's first) read two and write one, ``3d`` each, as the vanilla residual adds
    they replace (``3d`` for each of the ``N`` sublayers)::

        sum_i (S_i + 1) d + 3d (N - blocks) - 3d N

    (the paper's Appendix B.4 counting: block states read and outputs written, less the
    vanilla residual traffic; ``blocks = N`` for Full AttnRes, which has no partial sums)."""
    geo = AttnResGeometry.from_config(config)
    d, n = config.hidden_size, geo.num_sublayers
    reads = sum(len(geo.sources(i)) + 1 for i in range(1, geo.head + 1)) * d
    return reads + 3 * d * (n - geo.num_blocks) - 3 * d * n


def extra_params(config, tp: int = 1) -> ExtraParams:
    """A read's pseudo-query ``w`` and key-norm gain, ``2d`` (replicated): two reads per
    stored layer (attention, MLP; shared by a looped layer's loops), one in the head."""
    d = config.hidden_size
    return ExtraParams(layers=(2 * 2 * d,) * config.num_layers, head=2 * d)


def saved_activations(config, tp: int, micro_batch: int) -> SavedActivations:
    """Each read over ``n`` sources (every sublayer, and the head) saves the stacked
    sources twice (values and normalised keys) and the flattened keys, ``3 n h``, plus
    their 1/rms and softmax weights ``2n`` (on the sequence shard)."""
    geo = AttnResGeometry.from_config(config)
    t = tp if config.sequence_parallel else 1
    per_read = lambda i: (3 * config.hidden_size + 2) * len(geo.sources(i)) / t  # noqa: E731
    layers: dict = {}
    for i in range(1, geo.head):
        layers[geo.layer_of(i)] = layers.get(geo.layer_of(i), 0.0) + per_read(i)
    return SavedActivations(layers=layers, head=per_read(geo.head))


def step_work(config, tokens: int) -> List[OpCall]:
    """One ``attnres`` read per sublayer and the head, over its ``S_i`` sources."""
    geo = AttnResGeometry.from_config(config)
    return [OpCall("attnres", "head" if i == geo.head else f"sublayer {i}", "attnres.work",
                   (tokens, config.hidden_size, len(geo.sources(i))))
            for i in range(1, geo.head + 1)]


_HOOKS = dict(plan=attnres_plan, model_spec=model_hook(__name__, "get_attnres_model_spec"),
              kernels=("attnres",), extra_flops_per_token=extra_flops_per_token,
              extra_io_per_token=extra_io_per_token, extra_params=extra_params,
              saved_activations=saved_activations, step_work=step_work)
MIXER_FULL = Mixer(name="attnres_full", config_cls=AttnResConfig, **_HOOKS,
                   variants=(Variant(recompute_rtol=SUMMED),))
MIXER_BLOCK = Mixer(
    name="attnres_block", config_cls=BlockAttnResConfig, **_HOOKS,
    bind=model_hook(__name__, "bind_two_phase"),
    variants=(
        Variant("bs4", {"block_size": 4}, checks=("decode", "recompute", "generate"),
                recompute_rtol=SUMMED),
        Variant("bs3", {"block_size": 3}, checks=("transport",)),
        Variant("bs2", {"block_size": 2}, checks=("accounting", "parity", "kernels")),
        Variant("bs4-looped-swa3", {"block_size": 4, "short_swa_window": 3}, model=LOOPED,
                checks=("accounting",)),
    ))
MIXERS = {m.name: m for m in (MIXER_FULL, MIXER_BLOCK)}
