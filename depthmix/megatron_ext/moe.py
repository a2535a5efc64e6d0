"""The mixture-of-experts sublayer: Megatron-Core's ``MoELayer`` in the layer's MLP slot.

:func:`get_moe_spec` is Megatron's own MoE spec for local (non-Transformer-Engine) modules
(the layer :class:`ExpertGroupsMoE`, whose experts reduce over their own data-parallel group
at every expert-parallel size): the top-k router, the all-to-all token dispatcher,
``SequentialMLP`` experts (SwiGLU MLPs run one after the other: the reference and the CPU
path; :class:`SeededExperts`, initialised alike at every expert-parallel size) or, with
``model.moe.experts_impl=grouped``, the same experts as grouped GEMMs
(:mod:`depthmix.megatron_ext.grouped_experts`), and a ``SharedExpertMLP`` when
``model.moe.shared_expert_ffn_hidden_size`` is set. Its router is :class:`ExpertLoadRouter`,
Megatron's ``TopKRouter`` that also counts what it routes for the console and W&B
(:mod:`depthmix.pretrain.experts`).

To a depth mixer the MoE sublayer is an MLP: it reads the sublayer input from the depth
state before it and writes its output after it (``megatron_ext/specs.py`` puts this spec
in the MLP slot of the MoE layers).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_rank

from depthmix.megatron_ext.grouped_experts import GroupedExperts


class ExpertLoadRouter(TopKRouter):
    """``TopKRouter`` counting, over the training forwards since the last :meth:`take`, the
    token-expert assignments each expert received and the assignments made (tokens x top-k;
    the difference is what capacity dropped). Like Megatron's expert-bias counts it counts
    only where gradients are on: an evaluation or a statistics pass does not count, and a
    layer recomputed in backward counts once. Integer buffers: ``Float16Module`` leaves
    them alone, and they are not checkpointed."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.register_buffer("routed", torch.zeros(config.num_moe_experts, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("assigned", torch.zeros((), dtype=torch.int64), persistent=False)

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        """The expert-bias token counts (Megatron's, without its ``torch.compile`` wrapper:
        a compile per process, with a C++ compiler on CPU, for one addition; a compiled
        layer, ``train.compile``, takes it in with the rest). depthmix passes no padding
        mask."""
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def routing(self, logits, padding_mask=None):
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        if torch.is_grad_enabled():
            with torch.no_grad():
                self.routed += routing_map.sum(dim=0)
                self.assigned += routing_map.shape[0] * self.topk
        return probs, routing_map

    def take(self) -> torch.Tensor:
        """``[num_experts + 1]``: the assignments per expert, then those made; zeroes them."""
        out = torch.cat([self.routed, self.assigned.view(1)])
        self.routed.zero_()
        self.assigned.zero_()
        return out


class _SeededByGlobalIndex:
    """Experts (a ``SequentialMLP`` or a subclass) that draw their initial weights by their
    global index: expert ``g`` of a layer starts from the same weights whichever
    expert-parallel rank holds it, so every ``parallel.ep`` trains the same model from one
    seed (the layer's seed, :func:`depthmix.megatron_ext.model.seeded_init`, gives each
    expert's seed)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        from depthmix.megatron_ext.model import seeded_init

        super().__init__(0, config, submodules, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        base = int(torch.randint(0, 2**62, ()))  # one draw from the layer's stream
        first = get_pg_rank(self.ep_group) * num_local_experts
        for i in range(num_local_experts):
            with seeded_init(base + first + i):
                self.local_experts.append(MLP(
                    self.config, submodules, ffn_hidden_size=self.config.moe_ffn_hidden_size,
                    is_expert=True, tp_group=pg_collection.expt_tp))


class SeededExperts(_SeededByGlobalIndex, SequentialMLP):
    """Megatron's ``SequentialMLP``, seeded by global expert index."""


class SeededGroupedExperts(_SeededByGlobalIndex, GroupedExperts):
    """:class:`~depthmix.megatron_ext.grouped_experts.GroupedExperts`, seeded by global expert
    index (the same initial weights as :class:`SeededExperts`)."""


class ExpertGroupsMoE(MoELayer):
    """Megatron's ``MoELayer`` whose routed experts always reduce their gradients over the
    expert-data-parallel group and step in the experts' own optimizer (the second of the
    chained optimizers). Megatron does so only at ``expert_model_parallel_size > 1`` (it
    marks expert weights ``allreduce=False``); doing it at every size gives the optimizer
    state one structure whatever ``parallel.ep`` (a checkpoint moves between sizes), and
    reduces right where expert TP 1 under TP > 1 replicates the experts over the
    tensor-parallel ranks."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        super().__init__(config, submodules, layer_number=layer_number,
                         pg_collection=pg_collection)
        for param in self.experts.parameters():
            param.allreduce = False


def get_moe_spec(config) -> ModuleSpec:
    """Megatron's MoE layer spec for local modules, with :class:`ExpertGroupsMoE`,
    :class:`ExpertLoadRouter` and the experts ``config.moe_experts_impl`` names
    (:class:`SeededExperts` or :class:`SeededGroupedExperts`)."""
    experts = {"sequential": SeededExperts,
               "grouped": SeededGroupedExperts}.get(config.moe_experts_impl)
    if experts is None:
        raise ValueError(f"moe_experts_impl={config.moe_experts_impl!r} is not resolved "
                         "(sequential or grouped): model.moe.experts_impl is resolved at "
                         "start-up by config.load.resolve_experts_impl")
    spec = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=config.num_moe_experts,
                                           moe_grouped_gemm=False)
    spec.submodules = dataclasses.replace(spec.submodules, router=ExpertLoadRouter)
    assert spec.module is MoELayer and spec.submodules.experts.module is SequentialMLP
    spec.module, spec.submodules.experts.module = ExpertGroupsMoE, experts
    if config.moe_shared_expert_intermediate_size is None:
        spec.submodules.shared_experts = None
    return spec
