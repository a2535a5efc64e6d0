"""What the experts did between two log steps: per MoE layer, the tokens each expert took,
the assignments capacity dropped, the load-balancing loss and the router z-loss.

:class:`ExpertMeter` reads them on every rank at a log step (a collective, as the trainer's
other log-step reads): the counts from each :class:`~depthmix.megatron_ext.moe.ExpertLoadRouter`,
the losses from the layer-wise tracker Megatron's router writes them to (the values without
their coefficients, summed over micro-batches). One all-reduce over the world brings every
layer to every rank: a layer lives on one pipeline stage; data-parallel ranks (and, under
sequence parallelism, tensor-parallel ranks) route different tokens, so the counts add up;
the losses are averages over the data-parallel replicas (each tensor-parallel rank's load
loss is its share of the layer's: they add up, its z-loss is a mean over its tokens).
Expert-parallel ranks are data-parallel ranks of the dense model (or, with
``parallel.expert_tp=1``, tensor-parallel ones) that route their own tokens over all the
experts, so the same reductions hold: ``tests/parallel/test_parity.py`` checks the reading
against the single-rank one at every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

AUX_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss")
"""The names Megatron's router tracks its load-balancing loss under (batch, sequence scope)."""
Z_LOSS = "z_loss"


@dataclass
class ExpertLoad:
    """One reading, on every rank. Per MoE layer ``u`` (0-based, unique layers)."""

    layers: List[int]
    tokens: Dict[int, List[int]]
    """Token-expert assignments each expert received, summed over the interval."""
    assigned: Dict[int, int]
    """Assignments the router made (tokens x top-k); what the experts did not receive was
    dropped by capacity."""
    aux_loss: Optional[Dict[int, float]]
    """The load-balancing loss per micro-batch (without its coefficient); None when off."""
    z_loss: Optional[Dict[int, float]]

    def dropped(self, u: int) -> int:
        return self.assigned[u] - sum(self.tokens[u])

    def max_over_mean(self, u: int) -> float:
        """Tokens of the busiest expert over the mean (1: balanced; E: one expert took all)."""
        counts = self.tokens[u]
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean else 0.0

    def worst_layer(self) -> int:
        return max(self.layers, key=self.max_over_mean)

    @staticmethod
    def _mean(values: Optional[Dict[int, float]]) -> Optional[float]:
        return sum(values.values()) / len(values) if values else None

    def summary(self) -> str:
        """The console's expert-load line (after ``experts step N | ``)."""
        worst = self.worst_layer()
        assigned = sum(self.assigned.values())
        dropped = sum(self.dropped(u) for u in self.layers)
        share = 100.0 * dropped / assigned if assigned else 0.0
        counts = self.tokens[worst]
        return (f"load max/mean {self.max_over_mean(worst):.2f} at layer {worst} "
                f"({max(counts):,} vs {sum(counts) / len(counts):,.0f} tokens) | "
                f"dropped {dropped:,} of {assigned:,} ({share:.2f}%)")

    def losses(self) -> str:
        """`` | aux <mean over layers> | z <mean>`` for the losses that are on."""
        out = ""
        if self.aux_loss is not None:
            out += f" | aux {self._mean(self.aux_loss):.4f}"
        if self.z_loss is not None:
            out += f" | z {self._mean(self.z_loss):.4g}"
        return out

    def as_dict(self) -> Dict[str, float]:
        """W&B scalars: means over the MoE layers, then per layer."""
        data: Dict[str, float] = {
            "moe/load_max_over_mean": max(self.max_over_mean(u) for u in self.layers),
            "moe/dropped": float(sum(self.dropped(u) for u in self.layers)),
        }
        for name, values in (("aux_loss", self.aux_loss), ("z_loss", self.z_loss)):
            if values is not None:
                data[f"moe/{name}"] = self._mean(values)
                data.update({f"moe/{name}/layer{u}": v for u, v in values.items()})
        for u in self.layers:
            counts = self.tokens[u]
            data[f"moe/load_max_over_mean/layer{u}"] = self.max_over_mean(u)
            data[f"moe/tokens_max/layer{u}"] = float(max(counts))
            data[f"moe/tokens_mean/layer{u}"] = sum(counts) / len(counts)
            data[f"moe/dropped/layer{u}"] = float(self.dropped(u))
        return data


class ExpertMeter:
    """Counts micro-batches and reads the experts' statistics at log steps (collective)."""

    def __init__(self, model, config, tp: int, dp: int):
        from megatron.core.transformer.moe.moe_utils import (
            MoEAuxLossAutoScaler,
            get_moe_layer_wise_logging_tracker,
        )

        from depthmix.megatron_ext.model import unwrap
        from depthmix.megatron_ext.moe import ExpertLoadRouter

        self.routers = {
            module.layer_number - 1: module
            for chunk in model for module in unwrap(chunk).modules()
            if isinstance(module, ExpertLoadRouter)
        }
        self.num_layers, self.num_experts = config.num_layers, config.num_moe_experts
        self.layers = [u for u, on in enumerate(config.moe_layer_freq) if on]
        self.aux_on = config.moe_router_load_balancing_type != "none"
        self.z_on = config.moe_z_loss_coeff is not None
        self.tp, self.dp, self.n_loops = tp, dp, config.n_loops
        # a stage without MoE layers joins the all-reduce on the model's device all the same
        self.device = next(model[0].parameters()).device
        self.microbatches = 0
        # Megatron's tracker and its losses' gradient scale are process-wide: start from
        # nothing (an earlier model in this process may have had other layers, or left a
        # scale of another shape or device; the schedule sets it every micro-batch)
        get_moe_layer_wise_logging_tracker().clear()
        MoEAuxLossAutoScaler.main_loss_backward_scale = None

    def add_step(self, microbatches: int) -> None:
        self.microbatches += microbatches

    def read(self) -> ExpertLoad:
        """Collective: the statistics since the last read, on every rank; then zeroed."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        device = self.device
        counts = torch.zeros(self.num_layers, self.num_experts + 1, dtype=torch.float64,
                             device=device)
        for u, router in self.routers.items():
            counts[u] = router.take().to(counts)
        losses = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=device)
        tracker = get_moe_layer_wise_logging_tracker()
        for column, names in ((0, AUX_LOSSES), (1, (Z_LOSS,))):
            for name in names:
                if name in tracker:
                    losses[:, column] += tracker[name]["values"].to(losses)
                    tracker[name]["values"].zero_()
        both = torch.cat([counts, losses], dim=1)
        dist.all_reduce(both)
        counts, losses = both[:, :-2], both[:, -2:].clone()
        # per micro-batch forward of a layer (a looped layer runs n_loops times in one)
        forwards = max(self.microbatches, 1) * self.n_loops
        losses[:, 0] /= self.dp * forwards
        losses[:, 1] /= self.dp * self.tp * forwards
        self.microbatches = 0
        rows = counts.round().long().tolist()
        aux, z = losses.tolist(), losses[:, 1].tolist()
        return ExpertLoad(
            layers=self.layers,
            tokens={u: rows[u][:-1] for u in self.layers},
            assigned={u: rows[u][-1] for u in self.layers},
            aux_loss={u: aux[u][0] for u in self.layers} if self.aux_on else None,
            z_loss={u: z[u] for u in self.layers} if self.z_on else None,
        )
