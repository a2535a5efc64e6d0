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
from typing import Any, List, Tuple

import torch
from torch import Tensor

from depthmix.mixers.denseformer import DWAGeometry
from depthmix.megatron_ext.context import ForwardContext
from depthmix.planning.depth_plan import DepthState
from depthmix.megatron_ext.layer import HIDDEN, ResidualOp, StateHook
from depthmix.megatron_ext.layer import mark_mixing_parameter
from depthmix.megatron_ext.model import StateHead, StateStem
from depthmix.megatron_ext.specs import get_decoder_layer_submodules, get_model_submodules


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
    if not torch.is_grad_enabled():  # nothing to save; and Dynamo (2.13) cannot trace a
        return _weighted_sum(alpha, xs)  # no-grad apply whose forward takes *args
    return _WeightedSum.apply(alpha, *xs)


def _weighted_sum(alpha: Tensor, xs) -> Tensor:
    acc = _acc_dtype(xs[0].dtype)
    weights = alpha.to(acc).unbind()  # one op for the S scalars, not S selects
    out = weights[0] * xs[0].to(acc)
    for j in range(1, len(xs)):
        out = out + weights[j] * xs[j].to(acc)
    return out.to(xs[0].dtype)


class _WeightedSum(torch.autograd.Function):
    """The DWA as multiply-adds with a hand-written backward that saves the sources
    themselves: no stacked or fp32 copy is kept (the sources are depth state, alive anyway,
    except the block's own output ``X_i``), and compiled, forward and backward each fuse
    into one pass (a stack + ``tensordot`` is a copy plus a matrix product either way)."""

    @staticmethod
    def forward(ctx, alpha: Tensor, *xs: Tensor) -> Tensor:
        ctx.save_for_backward(alpha, *xs)
        return _weighted_sum(alpha, xs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        alpha, *xs = ctx.saved_tensors
        acc = _acc_dtype(xs[0].dtype)
        grad, weights = grad.to(acc), alpha.to(acc).unbind()
        grad_xs = [(weights[j] * grad).to(x.dtype) for j, x in enumerate(xs)]
        grad_alpha = torch.stack([(grad * x.to(acc)).sum() for x in xs]).to(alpha.dtype)
        return (grad_alpha, *grad_xs)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """``torch.promote_types(dtype, torch.float32)`` for float dtypes, without its ATen
    call (a host cost on every DWA)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
