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
from typing import Any, Tuple

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from depthmix.config.mixers.attnres import (  # noqa: F401  (re-exported)
    MIXER_BLOCK,
    MIXER_FULL,
    MIXERS,
    AttnResConfig,
    AttnResGeometry,
    BlockAttnResConfig,
    attnres_plan,
    extra_flops_per_token,
    extra_params,
)
from depthmix.kernels.attnres import attnres_op
from depthmix.megatron_ext.context import ForwardContext
from depthmix.megatron_ext.depth_state import DepthState
from depthmix.megatron_ext.layer import ResidualOp
from depthmix.megatron_ext.mixers.base import mark_mixing_parameter
from depthmix.megatron_ext.model import StateHead, StateStem
from depthmix.megatron_ext.norm import RMSNorm
from depthmix.megatron_ext.specs import get_decoder_layer_submodules, get_model_submodules


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
        self.attnres = attnres_op(config.mixer.impl)

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
