"""``mixer=attnres_full`` / ``attnres_block`` without their model code: options, the
sublayer geometry, plan and cost.

The method (Attention Residuals, Full and Block) and its Megatron modules are described
in :mod:`depthmix.megatron_ext.mixers.attnres`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List

from depthmix.config.mixers.base import ExtraParams, Mixer, MixerConfig, model_spec_in
from depthmix.config.schema import ConfigError
from depthmix.megatron_ext.depth_state import STEM, DepthState, Entry

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

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        _check_pre_norm(model)


@dataclass
class BlockAttnResConfig(MixerConfig):
    """Block Attention Residuals: attention over block sums and the current partial sum."""

    name: str = "attnres_block"
    block_size: int = 12
    """Sublayers per block (attention and MLP count separately). The paper's baseline is
    12 (about 8 blocks); 1 is Full AttnRes. Must divide ``2 * num_layers * n_loops``."""

    @property
    def sublayers_per_block(self) -> int:
        return self.block_size

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        _check_pre_norm(model)
        if self.block_size < 1:
            raise ConfigError(f"mixer.block_size={self.block_size} must be >= 1")
        sublayers = 2 * model.num_layers * model.n_loops
        if sublayers % self.block_size:
            raise ConfigError(
                f"mixer.block_size={self.block_size} must divide the number of sublayers "
                f"2 * model.num_layers * model.n_loops = {sublayers}"
            )


# ---------------------------------------------------------------------------------------
# Which entries a sublayer reads and writes
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnResGeometry:
    """Sources and writes of every sublayer; ``block_size = 1`` is Full AttnRes.

    Sublayers are 1-based, ``num_sublayers + 1`` is the head. Entry names: completed
    blocks ``b{k}`` (``y{s}`` for Full, where block ``s`` is sublayer ``s``), the
    running partial sum of block ``k`` ``p{k}``.
    """

    num_sublayers: int
    block_size: int = 1

    @classmethod
    def from_config(cls, config) -> "AttnResGeometry":
        return cls(2 * config.unrolled_layers, config.mixer.sublayers_per_block)

    @property
    def head(self) -> int:
        return self.num_sublayers + 1

    def block_name(self, k: int) -> str:
        return f"y{k}" if self.block_size == 1 else f"b{k}"

    @staticmethod
    def partial_name(k: int) -> str:
        return f"p{k}"

    def block_of(self, i: int) -> int:
        """Block of sublayer ``i >= 1`` (the head opens block ``N/m + 1``)."""
        return (i - 1) // self.block_size + 1

    def position_in_block(self, i: int) -> int:
        return (i - 1) % self.block_size

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
        if pos == self.block_size - 1:
            state[self.block_name(k)] = total
        else:
            state[self.partial_name(k)] = total

    def entries(self, hidden_size: int) -> List[Entry]:
        """The plan: exact writer and reader layers of every entry.

        A read by the layer that wrote the entry happens inside that layer and is not
        listed (the plan only describes layer boundaries).
        """
        n, m = self.num_sublayers, self.block_size
        out = []
        for k in range(n // m + 1):
            last = k * m  # the sublayer completing block k (0: the embedding)
            writer = STEM if k == 0 else self.layer_of(last)
            readers = sorted({self.layer_of(i) for i in range(last + 1, self.head + 1)} - {writer})
            out.append(Entry(self.block_name(k), (writer,), tuple(readers), (hidden_size,)))
        if m > 1:
            for k in range(1, n // m + 1):
                first = (k - 1) * m + 1
                writers = sorted({self.layer_of(i) for i in range(first, first + m - 1)})
                readers = sorted({self.layer_of(i) for i in range(first + 1, first + m)}
                                 - {writers[0]})
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


def extra_params(config, tp: int = 1) -> ExtraParams:
    """A read's pseudo-query ``w`` and key-norm gain, ``2d`` (replicated): two reads per
    stored layer (attention, MLP; shared by a looped layer's loops), one in the head."""
    d = config.hidden_size
    return ExtraParams(layers=(2 * 2 * d,) * config.num_layers, head=2 * d)


MIXER_FULL = Mixer(name="attnres_full", config_cls=AttnResConfig,
                   model_spec=model_spec_in("attnres", "get_attnres_model_spec"), plan=attnres_plan,
                   extra_flops_per_token=extra_flops_per_token, extra_params=extra_params)
MIXER_BLOCK = Mixer(name="attnres_block", config_cls=BlockAttnResConfig,
                    model_spec=model_spec_in("attnres", "get_attnres_model_spec"), plan=attnres_plan,
                    extra_flops_per_token=extra_flops_per_token, extra_params=extra_params)
MIXERS = {m.name: m for m in (MIXER_FULL, MIXER_BLOCK)}
