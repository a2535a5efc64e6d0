"""Attention Residuals, Full and Block (seeds 001/002): softmax attention over depth
replaces the residual sum.

Sublayers are numbered ``i = 1..N`` over the unrolled model (``N = 2 * layers``; layer
``l``'s attention is ``2l + 1``, its MLP ``2l + 2``), ``y_0`` is the embedding output and
``y_i`` sublayer ``i``'s output. Full AttnRes feeds sublayer ``i`` with::

    h_i = sum_{s < i} softmax_s(w_i . RMSNorm_i(y_s)) y_s

and the final norm reads one more such aggregate (``i = N + 1``, the model ``head``).
``w_i`` (the pseudo-query) starts at zero, so every read starts as the uniform average
of its sources -- through the pre-norm, the plain residual network.

Block AttnRes (``block_size = m``): the embedding is block 0; sublayers ``1..m`` form
block 1, ``m+1..2m`` block 2, and so on. A block's outputs are summed; sublayer ``i``
attends over the completed block sums ``b_0 .. b_{k-1}`` plus the partial sum of its
own block ``k``, ``p = sum of y over block k's sublayers before i``. At a block's first
sublayer that partial sum is empty and is left out (the seed-001 matrix view), so
``m = 1`` gives back Full AttnRes exactly.

Depth state (hidden-side, on the sequence-parallel shard): Full keeps ``y{s}``, every
sublayer output still to be read; Block keeps the completed sums ``b{k}`` and the
running partial ``p{k}``. The plan lists each entry's exact writer and reader layers, so
the pipeline transport sends into a chunk only what the receiving rank does not hold
yet (the paper's cross-stage caching), see ``docs/methods/attnres.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from depthmix.config.schema import ConfigError
from depthmix.kernels.dispatch import select
from depthmix.megatron_ext.context import ForwardContext
from depthmix.megatron_ext.depth_state import STEM, DepthState, Entry
from depthmix.megatron_ext.layer import ResidualOp
from depthmix.megatron_ext.mixers.base import ExtraParams, Mixer, MixerConfig, mark_mixing_parameter
from depthmix.megatron_ext.model import StateHead, StateStem
from depthmix.megatron_ext.norm import RMSNorm
from depthmix.megatron_ext.specs import get_decoder_layer_submodules, get_model_submodules


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

    @property
    def sublayers_per_block(self) -> int:
        assert self.block_size is not None, "resolve() derives block_size from num_blocks"
        return self.block_size

    def resolve(self, model) -> None:
        if self.block_size is None and self.num_blocks >= 1:
            sublayers = 2 * model.num_layers * model.n_loops
            self.block_size = max(1, -(-sublayers // self.num_blocks))

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        _check_pre_norm(model)
        if self.num_blocks < 1:
            raise ConfigError(f"mixer.num_blocks={self.num_blocks} must be >= 1")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"mixer.block_size={self.block_size} must be >= 1")
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


# ---------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------


class PseudoQueryRead(MegatronModule):
    """One AttnRes read: a zero-initialised pseudo-query and an RMSNorm on the keys."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config)
        self.query = torch.nn.Parameter(torch.zeros(config.hidden_size, dtype=config.params_dtype))
        self.key_norm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        for p in (self.query, self.key_norm.weight):
            mark_mixing_parameter(p, config)
        self.geometry = AttnResGeometry.from_config(config)
        # the op implementation is fixed here, from the start-up resolved mixer.impl
        self.attnres = select("attnres", config.mixer.impl)

    def aggregate(self, state: DepthState, i: int, return_weights: bool = False):
        """``h_i`` ``[s, b, h]`` over sublayer ``i``'s sources (and the weights
        ``[S, s, b]`` with ``return_weights``)."""
        sources = [state[name] for name in self.geometry.sources(i)]
        return self.attnres(sources, self.query, self.key_norm.weight, self.key_norm.eps,
                            return_weights=return_weights)


class AttnResResidual(ResidualOp):
    """``attn_residual`` / ``mlp_residual``: the sublayer reads an AttnRes aggregate and
    its output joins the depth state (no residual sum)."""

    def __init__(self, config, layer_number: int = 1, sublayer: str = "attn", **kwargs):
        super().__init__(config, layer_number=layer_number, sublayer=sublayer)
        self.read_op = PseudoQueryRead(config)

    def read(self, state: DepthState, ctx: ForwardContext) -> Tuple[Tensor, Any]:
        i = AttnResGeometry.sublayer(ctx.layer, self.sublayer)
        if ctx.stats is None:
            return self.read_op.aggregate(state, i), None
        x, weights = self.read_op.aggregate(state, i, return_weights=True)
        ctx.record(f"attnres_{self.sublayer}", weights.mean(dim=(1, 2)))
        return x, None

    def write(self, state: DepthState, output: Tensor, token: Any, ctx: ForwardContext) -> None:
        i = AttnResGeometry.sublayer(ctx.layer, self.sublayer)
        self.read_op.geometry.write(state, i, output)


class AttnResStem(StateStem):
    """The embedding output is source ``y_0`` (block 0)."""

    def forward(self, embeddings: Tensor) -> DepthState:
        return {AttnResGeometry.from_config(self.config).block_name(0): embeddings}


class AttnResHead(StateHead):
    """The final norm reads one more aggregate, over every block (sublayer ``N + 1``)."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config)
        self.read_op = PseudoQueryRead(config)

    def forward(self, state: DepthState, ctx: ForwardContext) -> Tensor:
        head = self.read_op.geometry.head
        if ctx.stats is None:
            return self.read_op.aggregate(state, head)
        x, weights = self.read_op.aggregate(state, head, return_weights=True)
        ctx.stats["head/attnres"] = weights.mean(dim=(1, 2)).detach().float()
        return x


def get_attnres_model_spec(config):
    layer = dataclasses.replace(get_decoder_layer_submodules(config),
                                attn_residual=AttnResResidual, mlp_residual=AttnResResidual)
    return get_model_submodules(config, layer, stem=AttnResStem, head=AttnResHead)


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


MIXER_FULL = Mixer(name="attnres_full", config_cls=AttnResConfig,
                   model_spec=get_attnres_model_spec, plan=attnres_plan,
                   extra_flops_per_token=extra_flops_per_token, extra_io_per_token=extra_io_per_token,
                   extra_params=extra_params)
MIXER_BLOCK = Mixer(name="attnres_block", config_cls=BlockAttnResConfig,
                    model_spec=get_attnres_model_spec, plan=attnres_plan,
                    extra_flops_per_token=extra_flops_per_token, extra_io_per_token=extra_io_per_token,
                   extra_params=extra_params)
MIXERS = {m.name: m for m in (MIXER_FULL, MIXER_BLOCK)}
