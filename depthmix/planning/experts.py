"""Mixture-of-experts layers in the accounting (``model.moe``; docs/moe.md): what an MoE
layer's MLP sublayer (Megatron-Core's ``MoELayer``: the router, the routed SwiGLU experts,
the shared expert) holds, computes, saves for backward and sends, for the FLOP and
parameter counts (:mod:`depthmix.planning.flops`), the memory model
(:mod:`depthmix.planning.memory`) and the step-time model
(:mod:`depthmix.planning.step_time`). Megatron-free.

Notation: ``h`` hidden, ``E`` routed experts, ``k`` experts per token (top-k), ``f_e`` one
expert's SwiGLU width, ``f_s`` the shared expert's (0: none), ``ep`` expert-parallel size;
the experts' own tensor parallelism is Megatron's default, ``expert_tensor_parallel_size =
tp``, so an expert's width is split over ``tp`` like a dense MLP's.

Parameters of one MoE layer's MLP::

    router      E h                      replicated on every TP rank
    experts     E / ep x 3 h f_e / tp    on one TP x EP rank (gate, up, down)
    shared      3 h f_s / tp
    activated   E h + k 3 h f_e + 3 h f_s   (what one token runs through)

Forward FLOPs per token of one MoE layer's MLP: 2 x the activated parameters (the router's
GEMM, the k experts' SwiGLUs, the shared expert). The routed term counts ``k`` experts for
every token, also where a capacity factor drops assignments (the configured model, as
Megatron-LM counts it): an MFU measured with drops is that much optimistic.

Saved for backward per micro-batch (bytes; ``n`` = ``b s`` tokens of the micro-batch,
``n_l = n / tp`` routed on one rank under sequence parallelism, ``e`` activation bytes,
``r`` = rows the rank's experts process, ``n k`` when the router balances; as measured by
tests/planning/memory_probe.py on Megatron-Core 0.16.1's local modules)::

    routing     n_l (8k + 4k)            top-k indices (int64) and weights (fp32)
                  softmax without normalize_top_k: 4E instead of 4k (all probabilities)
                  sigmoid: + 4E + 4 [k > 1]   (scores, the weights' sum)
    balance     n_l (4E + 8k) + 8E       scores and top-k map of the loss (+4 n_l with
                                         sigmoid), tokens per expert (per sequence: 8 b E)
    z-loss      n_l (4E + 4)             logits, log-sum-exp
    capacity    n_l E + 8 E c_e          the over-capacity mask, the capacity top-k
                                         (c_e = ceil(c n_l k / E) slots an expert)
    permute     n_l (5E + 8k)            routing map (bool), probabilities, row order
    experts     r (h e + 6 f_e / tp e + 4)
                                         permuted tokens, fc1 output, SwiGLU and the
                                         weighted product, fc2 input, the weights (fp32)
    shared      n 5 f_s / tp e           as a dense MLP of width f_s

The router's input is the MLP norm's output, already counted with the norms. Routing
bound: how many rows ``r`` the rank's experts can receive per micro-batch token at most --
dropless, every token of the EP x TP group routed to this rank's experts,
``ep min(k, E / ep)`` (``k`` at ``ep = 1``: nothing to imbalance); with a capacity factor
at most ``E c_e`` slots from each of the ``ep tp`` ranks, ``E c_e tp / n`` a token.

All-to-all (``alltoall`` dispatcher), per MoE layer and micro-batch: dispatch and combine
in forward, their gradients in backward (and the forward pair again under full
recomputation), each moving the rank's ``n_l k`` routed rows of ``h e`` bytes, of which
``(ep - 1) / ep`` leave the rank when the router balances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from depthmix.config.schema import RunConfig


@dataclass(frozen=True)
class Experts:
    """The MoE layers of a run's model: where they are and how wide (None: dense)."""

    hidden: int
    experts: int
    top_k: int
    ffn: int
    """One routed expert's SwiGLU width ``f_e``."""
    shared_ffn: int
    moe_layers: Tuple[bool, ...]
    """Per stored layer: whether its MLP is an MoE layer."""
    score_function: str
    normalize_top_k: bool
    balance: Optional[str]
    """``batch`` / ``sequence`` balance loss, None when off."""
    z_loss: bool
    capacity_factor: Optional[float]
    """None: dropless."""

    @classmethod
    def of(cls, run: RunConfig) -> Optional["Experts"]:
        m, e = run.model, run.model.experts
        if e is None:
            return None
        return cls(hidden=m.hidden_size, experts=e.num_experts, top_k=e.top_k,
                   ffn=e.expert_ffn_hidden_size(m), shared_ffn=e.shared_expert_ffn_hidden_size,
                   moe_layers=tuple(e.is_moe_layer(i) for i in range(m.num_layers)),
                   score_function=e.score_function, normalize_top_k=e.normalize_top_k,
                   balance=e.aux_loss_scope if e.aux_loss_coeff > 0 else None,
                   z_loss=e.z_loss_coeff > 0,
                   capacity_factor=None if e.dropless else e.capacity_factor)

    def is_moe(self, layer: int) -> bool:
        """Whether stored (or unrolled: loops repeat the stored layers) ``layer`` is MoE."""
        return self.moe_layers[layer % len(self.moe_layers)]

    # -- parameters and FLOPs ------------------------------------------------------------

    def router_params(self) -> int:
        return self.experts * self.hidden

    def expert_params(self, tp: int = 1, ep: int = 1) -> int:
        """The routed experts of one layer on one TP x EP rank."""
        return self.experts // ep * 3 * self.hidden * self.ffn // tp

    def shared_params(self, tp: int = 1) -> int:
        return 3 * self.hidden * self.shared_ffn // tp

    def activated_params(self) -> int:
        """What one token runs through in one MoE layer's MLP."""
        return self.router_params() + self.top_k * 3 * self.hidden * self.ffn \
            + self.shared_params()

    def forward_flops_per_token(self) -> int:
        return 2 * self.activated_params()

    # -- saved for backward ----------------------------------------------------------------

    def capacity(self, local_tokens: int) -> Optional[int]:
        """Slots of one expert for a rank's ``local_tokens`` (Megatron's ``get_capacity``)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(local_tokens * self.top_k / self.experts * self.capacity_factor)

    def routing_bytes(self, local_tokens: int, micro_batch: int) -> float:
        """Router, losses and permutation on one rank, per micro-batch (module doc)."""
        E, k, n = self.experts, self.top_k, local_tokens
        per_token = 8 * k + 5 * E + 8 * k  # top-k indices; permute: map, probs, row order
        if self.score_function == "sigmoid":
            per_token += 4 * E + 4 * k + (4 if k > 1 else 0)
        else:
            per_token += 4 * k if self.normalize_top_k else 4 * E
        fixed = 0.0
        if self.balance:
            per_token += 4 * E + 8 * k + (4 if self.score_function == "sigmoid" else 0)
            fixed += 8 * E * (micro_batch if self.balance == "sequence" else 1) + 4
        if self.z_loss:
            per_token += 4 * E + 4
            fixed += 4
        if self.capacity_factor is not None:
            per_token += E
            fixed += 8 * E * self.capacity(n)
        return n * per_token + fixed

    def row_bytes(self, tp: int, act: int) -> float:
        """One routed row at the experts: its token, the SwiGLU's saved tensors, its weight."""
        return self.hidden * act + 6 * self.ffn / tp * act + 4

    def rows_bound(self, tokens: int, tp: int, sp: bool, ep: int) -> float:
        """Rows per micro-batch token the rank's experts can receive at most (module doc)."""
        dropless = ep * min(self.top_k, self.experts // ep)
        if self.capacity_factor is None:
            return dropless
        t = tp if sp else 1
        return min(dropless, self.experts * self.capacity(tokens // t) * t / tokens)

    def saved_bytes(self, tokens: int, micro_batch: int, tp: int, sp: bool, act: int,
                    rows_per_token: Optional[float] = None) -> float:
        """One MoE layer's MLP on one rank, per micro-batch of ``tokens`` (``b s``) tokens,
        at ``rows_per_token`` routed rows a token (default ``k``: a balanced router)."""
        t = tp if sp else 1
        rows = (self.top_k if rows_per_token is None else rows_per_token) * tokens
        shared = tokens * 5 * self.shared_ffn / tp * act
        return (self.routing_bytes(tokens // t, micro_batch) + rows * self.row_bytes(tp, act)
                + shared)

    # -- communication -------------------------------------------------------------------

    def alltoall_bytes(self, tokens: int, tp: int, sp: bool, ep: int, act: int) -> float:
        """Bytes one all-to-all (a dispatch or a combine) sends off the rank per MoE layer
        and micro-batch of ``tokens`` tokens, the router balancing."""
        t = tp if sp else 1
        return tokens / t * self.top_k * self.hidden * act * (ep - 1) / ep
