"""DenseFormer (Pagliardini et al., 2024): a depth-weighted average after the blocks.

With ``X_0`` the embedding output, block ``i = 1..L`` (unrolled layer ``i - 1``) and
``X_i`` its output (residual connections included), DenseFormer feeds each block with
the previous depth-weighted average (DWA)::

    X_i = B_i(Y_{i-1}),   Y_i = sum_{j in S(i)} alpha_{i,j} X_j,   Y_0 = X_0

and the final norm reads ``Y_L``. The DWA averages the *block outputs* ``X_j``, not
earlier averages (paper Eq. 1; the reference code stores ``X_j`` in its accumulators).
``alpha_{i,i} = 1`` and the rest 0 at init, so the model starts as the plain one.

Options (paper Sec. 3.2, "k x p-DenseFormer"):

* ``dilation`` ``k``: ``S(i) = {j <= i : j = i (mod k)}`` (``i, i-k, i-2k, ...``);
* ``period`` ``p``: a DWA only after blocks with ``i % p == 0``; elsewhere ``Y_i = X_i``.

Depth state (hidden-side, on the sequence-parallel shard): ``x{j}`` for the block outputs
a later DWA still reads (or the next block reads, where no DWA followed), ``y{i}`` for
the DWA output the next block reads. Inside a layer the stream is the usual ``h``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Tuple

import torch
from torch import Tensor

from depthmix.config.schema import ConfigError
from depthmix.megatron_ext.context import ForwardContext
from depthmix.megatron_ext.depth_state import STEM, DepthState, Entry
from depthmix.megatron_ext.layer import HIDDEN, ResidualOp, StateHook
from depthmix.megatron_ext.mixers.base import ExtraParams, Mixer, MixerConfig, mark_mixing_parameter
from depthmix.megatron_ext.model import StateHead, StateStem
from depthmix.megatron_ext.specs import get_decoder_layer_submodules, get_model_submodules


@dataclass
class DenseFormerConfig(MixerConfig):
    """Depth-weighted averages over the embedding and the earlier block outputs."""

    name: str = "denseformer"
    dilation: int = 1
    """``k``: a DWA after block ``i`` reads only ``X_j`` with ``j = i (mod k)``."""
    period: int = 1
    """``p``: a DWA only after every ``p``-th block (``i % p == 0``)."""

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        if self.dilation < 1:
            raise ConfigError(f"mixer.dilation={self.dilation} must be >= 1")
        if self.period < 1:
            raise ConfigError(f"mixer.period={self.period} must be >= 1")


@dataclass(frozen=True)
class DWAGeometry:
    """Which blocks have a DWA, what it averages, and the depth-state entries."""

    num_blocks: int
    dilation: int = 1
    period: int = 1

    @classmethod
    def from_config(cls, config) -> "DWAGeometry":
        return cls(config.unrolled_layers, config.mixer.dilation, config.mixer.period)

    def has_dwa(self, i: int) -> bool:
        return i >= 1 and i % self.period == 0

    def sources(self, i: int) -> List[int]:
        """``S(i)`` in increasing order (the last one is ``i``)."""
        return list(range(i % self.dilation, i + 1, self.dilation))

    @staticmethod
    def output_name(j: int) -> str:
        return f"x{j}"

    @staticmethod
    def average_name(i: int) -> str:
        return f"y{i}"

    def stream(self, i: int) -> str:
        """Entry holding ``Y_i``, the input of block ``i + 1`` (``i = L``: the head's)."""
        return self.average_name(i) if self.has_dwa(i) else self.output_name(i)

    def output_readers(self, j: int) -> List[int]:
        """Layers reading ``X_j`` after it is written (``num_blocks`` = the head)."""
        readers = [i - 1 for i in range(j + self.dilation, self.num_blocks + 1, self.dilation)
                   if self.has_dwa(i)]
        if not self.has_dwa(j):
            readers.append(j)  # X_j is Y_j: block j + 1 (or the head) reads it
        return sorted(readers)

    def entries(self, hidden_size: int) -> List[Entry]:
        out = []
        for j in range(self.num_blocks + 1):
            readers = self.output_readers(j)
            if readers:
                writer = STEM if j == 0 else j - 1
                out.append(Entry(self.output_name(j), (writer,), tuple(readers), (hidden_size,)))
            if self.has_dwa(j):
                out.append(Entry(self.average_name(j), (j - 1,), (j,), (hidden_size,)))
        return out


def denseformer_plan(config, tp: int) -> List[Entry]:
    return DWAGeometry.from_config(config).entries(config.hidden_size)


class DenseFormerInput(ResidualOp):
    """``attn_residual``: the block reads ``Y_{i-1}``; inside the layer the stream is ``h``."""

    def __init__(self, config, layer_number: int = 1, sublayer: str = "attn", **kwargs):
        super().__init__(config, layer_number=layer_number, sublayer=sublayer, **kwargs)
        self.geometry = DWAGeometry.from_config(config)

    def read(self, state: DepthState, ctx: ForwardContext) -> Tuple[Tensor, Any]:
        x = state[self.geometry.stream(ctx.layer)]
        return x, x

    def write(self, state: DepthState, output: Tensor, token: Any, ctx: ForwardContext) -> None:
        hidden = token + output
        state[HIDDEN] = self.post_norm(hidden) if self.post_norm is not None else hidden


class DepthWeightedAverage(StateHook):
    """``post_layer``: keeps ``X_i`` if it is read later and, after every ``p``-th block,
    writes ``Y_i = sum_j alpha_{i,j} X_j``.

    A looped transformer applies one module at several depths; it holds one weight
    vector per depth with a DWA (``alpha["<i>"]``, ``len(S(i))`` scalars).
    """

    def __init__(self, config, layer_number: int = 1, **kwargs):
        super().__init__(config, layer_number=layer_number)
        self.geometry = geo = DWAGeometry.from_config(config)
        depths = [t * config.num_layers + layer_number for t in range(config.n_loops)]
        self.alpha = torch.nn.ParameterDict()
        for i in depths:
            if geo.has_dwa(i):
                init = torch.zeros(len(geo.sources(i)), dtype=config.params_dtype)
                init[-1] = 1.0  # identity: Y_i = X_i
                p = torch.nn.Parameter(init)
                mark_mixing_parameter(p, config)
                self.alpha[str(i)] = p

    def forward(self, state: DepthState, ctx: ForwardContext, *args) -> None:
        geo, i = self.geometry, ctx.layer + 1
        x_i = state.pop(HIDDEN)
        if geo.has_dwa(i):
            alpha = self.alpha[str(i)]
            xs = [state[geo.output_name(j)] for j in geo.sources(i)[:-1]] + [x_i]
            state[geo.average_name(i)] = depth_weighted_average(xs, alpha)
            if ctx.stats is not None:
                ctx.record("dwa_weights", alpha)
        if geo.output_readers(i):
            state[geo.output_name(i)] = x_i


def depth_weighted_average(xs: List[Tensor], alpha: Tensor) -> Tensor:
    """``sum_j alpha_j xs[j]``, accumulated in fp32 (fp64 for fp64), ``xs[j] [s, b, h]``."""
    acc = torch.promote_types(xs[0].dtype, torch.float32)
    stacked = torch.stack([x.to(acc) for x in xs])  # [S, s, b, h]
    return torch.tensordot(alpha.to(acc), stacked, dims=1).to(xs[0].dtype)


class DenseFormerStem(StateStem):
    def forward(self, embeddings: Tensor) -> DepthState:
        return {DWAGeometry.output_name(0): embeddings}


class DenseFormerHead(StateHead):
    """The final norm reads ``Y_L``."""

    def forward(self, state: DepthState, ctx: ForwardContext) -> Tensor:
        geo = DWAGeometry.from_config(self.config)
        return state[geo.stream(geo.num_blocks)]


def get_denseformer_model_spec(config):
    layer = get_decoder_layer_submodules(config)
    layer = dataclasses.replace(
        layer,
        attn_residual=dataclasses.replace(layer.attn_residual, module=DenseFormerInput),
        post_layer=DepthWeightedAverage,
    )
    return get_model_submodules(config, layer, stem=DenseFormerStem, head=DenseFormerHead)


def extra_flops_per_token(config) -> int:
    """Forward FLOPs per token added to a vanilla decoder (whole model, ``d`` hidden)::

        sum over the blocks i = 1..L with a DWA (p | i) of 2 d |S(i)|,  |S(i)| = floor(i/k) + 1

    the weighted sum ``Y_i = sum_j alpha_{i,j} X_j`` (one multiply-add per source and
    element); ``d L (L + 3)`` for ``1 x 1``. Nothing is left out.
    """
    geo = DWAGeometry.from_config(config)
    return 2 * config.hidden_size * sum(len(geo.sources(i)) for i in range(1, geo.num_blocks + 1)
                                        if geo.has_dwa(i))


def extra_io_per_token(config) -> int:
    """Activation elements read and written per token beyond vanilla (whole model, ``d``
    hidden): each DWA reads its ``|S(i)|`` sources and writes the average::

        sum over the blocks i with a DWA of (|S(i)| + 1) d

    (the paper's Appendix B.3; ``d (L (L + 5) / 2)`` for ``1 x 1``). The residual adds stay."""
    geo = DWAGeometry.from_config(config)
    return config.hidden_size * sum(len(geo.sources(i)) + 1
                                    for i in range(1, geo.num_blocks + 1) if geo.has_dwa(i))


def extra_params(config, tp: int = 1) -> ExtraParams:
    """The DWA weights ``alpha_i`` (``|S(i)|`` scalars, replicated), held by the stored
    layer applied at depth ``i``: stored layer ``u`` owns depths ``t * num_layers + u + 1``
    over the loops ``t``, so the count grows with depth; ``L (L + 3) / 2`` for ``1 x 1``."""
    geo = DWAGeometry.from_config(config)
    n = config.num_layers
    return ExtraParams(layers=tuple(
        sum(len(geo.sources(i)) for i in range(u + 1, geo.num_blocks + 1, n) if geo.has_dwa(i))
        for u in range(n)))


MIXER = Mixer(name="denseformer", config_cls=DenseFormerConfig,
              model_spec=get_denseformer_model_spec, plan=denseformer_plan,
              extra_flops_per_token=extra_flops_per_token, extra_io_per_token=extra_io_per_token,
              extra_params=extra_params)
