"""Attention Residuals, Full and Block (the Attention Residuals paper): softmax attention
over depth replaces the residual sum.

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

Inference through a KV cache uses the paper's two-phase reads for Block AttnRes
(``mixer.two_phase``, :class:`TwoPhaseReads`): a block's completed-block reads for all its
sublayers at once, then each sublayer's partial-sum term merged by online softmax.
"""


from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from depthmix.mixers.attnres import AttnResGeometry
from depthmix.kernels.attnres.two_phase import inter_block_partials, merge_partial
from depthmix.kernels.dispatch import select
from depthmix.megatron_ext.context import ForwardContext
from depthmix.planning.depth_plan import DepthState
from depthmix.megatron_ext.layer import ResidualOp
from depthmix.megatron_ext.layer import mark_mixing_parameter
from depthmix.megatron_ext.model import StateHead, StateStem
from depthmix.megatron_ext.norm import RMSNorm, is_plain_rmsnorm
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
        self.attnres = select("attnres", config.mixer.impl)
        self.fuses_norm = config.mixer.impl == "triton"
        """The kernel applies the sublayer's input RMSNorm to ``h_i`` (its output norm)."""

    def aggregate(self, state: DepthState, i: int, return_weights: bool = False,
                  ctx: Optional[ForwardContext] = None, norm: Optional[RMSNorm] = None):
        """``h_i`` ``[s, b, h]`` over sublayer ``i``'s sources, or ``norm(h_i)`` (and the
        weights ``[S, s, b]`` with ``return_weights``)."""
        names = self.geometry.sources(i)
        if ctx is not None and ctx.inference is not None:
            count_reads(ctx, len(names), sum(1 for n in names if not n.startswith("p")))
        if norm is not None:
            return self.attnres([state[n] for n in names], self.query, self.key_norm.weight,
                                self.key_norm.eps, norm.weight, norm.eps)
        return self.attnres([state[n] for n in names], self.query, self.key_norm.weight,
                            self.key_norm.eps, return_weights=return_weights)


def count_reads(ctx: ForwardContext, reads: int, block_reads: int) -> None:
    """Per-token depth-source reads of this forward, on the KV cache's counters."""
    ctx.inference.count("attnres/source_reads", reads)
    ctx.inference.count("attnres/block_reads", block_reads)


class TwoPhaseReads:
    """Two-phase inference reads of one model chunk (see ``kernels/attnres/two_phase.py``).

    Bound by :func:`bind_two_phase` to the read op of every sublayer the chunk runs. At a
    block's first sublayer, phase 1 computes the partials of all the block's sublayers and
    keeps them in the forward's context until the block's last sublayer has read.
    """

    def __init__(self, geometry: AttnResGeometry, reads: Dict[int, PseudoQueryRead]):
        self.geometry, self.reads = geometry, reads

    def covers(self, i: int) -> bool:
        """Whether every sublayer of ``i``'s block runs in this chunk (else per-sublayer reads)."""
        geo = self.geometry
        return all(j in self.reads for j in geo.block_range(geo.block_of(i)))

    def aggregate(self, state: DepthState, i: int, ctx: ForwardContext) -> Tensor:
        geo = self.geometry
        k, row = geo.block_of(i), geo.position_in_block(i)
        key = f"attnres/two_phase/{k}"
        if row == 0:
            ops = [self.reads[j] for j in geo.block_range(k)]
            ctx.extras[key] = inter_block_partials(
                [state[geo.block_name(j)] for j in range(k)],
                torch.stack([op.query for op in ops]),
                torch.stack([op.key_norm.weight for op in ops]), ops[0].key_norm.eps)
            count_reads(ctx, k, k)
        partials = ctx.extras[key]
        partial = state[geo.partial_name(k)] if row > 0 else None
        if partial is not None:
            count_reads(ctx, 1, 0)
        if i == geo.block_range(k)[-1]:
            del ctx.extras[key]
        op = self.reads[i]
        return merge_partial(partials, row, partial, op.query, op.key_norm.weight,
                             op.key_norm.eps, state[geo.block_name(0)].dtype)


def bind_two_phase(model) -> None:
    """``Mixer.bind``: give the residual ops of a Block AttnRes chunk (with
    ``mixer.two_phase``) one shared :class:`TwoPhaseReads` over all its sublayers."""
    if not model.config.mixer.uses_two_phase:
        return
    geo = AttnResGeometry.from_config(model.config)
    ops = {}
    for u, layer in model.decoder.unrolled():
        for which in ("attn", "mlp"):
            ops[geo.sublayer(u, which)] = getattr(layer, f"{which}_residual")
    reads = TwoPhaseReads(geo, {i: op.read_op for i, op in ops.items()})
    for op in ops.values():
        op.two_phase = reads  # a plain attribute: ``reads`` refers to modules, owns none


class AttnResResidual(ResidualOp):
    """``attn_residual`` / ``mlp_residual``: the sublayer reads an AttnRes aggregate and
    its output joins the depth state (no residual sum)."""

    def __init__(self, config, layer_number: int = 1, sublayer: str = "attn", **kwargs):
        super().__init__(config, layer_number=layer_number, sublayer=sublayer)
        self.read_op = PseudoQueryRead(config)
        self.two_phase: Optional[TwoPhaseReads] = None
        """Set by :func:`bind_two_phase`; used for forwards through a KV cache."""

    def _two_phase(self, ctx: ForwardContext, i: int) -> bool:
        return (ctx.inference is not None and ctx.stats is None and self.two_phase is not None
                and self.two_phase.covers(i))

    def read(self, state: DepthState, ctx: ForwardContext) -> Tuple[Tensor, Any]:
        i = AttnResGeometry.sublayer(ctx.layer, self.sublayer)
        if self._two_phase(ctx, i):
            return self.two_phase.aggregate(state, i, ctx), None
        if ctx.stats is None:
            return self.read_op.aggregate(state, i, ctx=ctx), None
        x, weights = self.read_op.aggregate(state, i, return_weights=True)
        ctx.record(f"attnres_{self.sublayer}", weights.mean(dim=(1, 2)))
        return x, None

    def read_normed(self, state: DepthState, ctx: ForwardContext, norm) -> Tuple[Tensor, Any]:
        """With the Triton kernel, the input RMSNorm is the kernel's output norm."""
        i = AttnResGeometry.sublayer(ctx.layer, self.sublayer)
        if (self.read_op.fuses_norm and is_plain_rmsnorm(norm) and ctx.stats is None
                and not self._two_phase(ctx, i)):
            return self.read_op.aggregate(state, i, ctx=ctx, norm=norm), None
        return super().read_normed(state, ctx, norm)

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
            return self.read_op.aggregate(state, head, ctx=ctx)
        x, weights = self.read_op.aggregate(state, head, return_weights=True)
        ctx.stats["head/attnres"] = weights.mean(dim=(1, 2)).detach().float()
        return x


def get_attnres_model_spec(config):
    layer = dataclasses.replace(get_decoder_layer_submodules(config),
                                attn_residual=AttnResResidual, mlp_residual=AttnResResidual)
    return get_model_submodules(config, layer, stem=AttnResStem, head=AttnResHead)
