"""Which layers each pipeline chunk holds (:class:`PipelineLayout`), and what depth state
crosses each stage boundary and how large it is (:class:`TransportGeometry`), known at
start-up without torch: the model's transport (``depthmix.megatron_ext.transport``), the
memory model, the dry run and the tools read the same geometry.

Megatron's interleaved assignment: with ``P`` pipeline ranks and ``V`` virtual stages,
the model is cut into ``P * V`` equal chunks; chunk ``c = v * P + r`` lives on pipeline
rank ``r`` as its ``v``-th model chunk. Plain 1F1B is ``V = 1``.

What a transition into chunk ``c`` carries (``c - P`` the chunk the receiving rank ran
before ``c``): every entry live at ``c``'s first layer whose current version was written
at or after the end of chunk ``c - P``. Anything older the receiving rank already holds:
it either produced it or received it when entering ``c - P``; without interleaving
(``V = 1``) there is no earlier chunk on the receiver and everything live is sent.

Bytes per transition into chunk ``c`` (payload; ``e`` = element size, ``b`` = micro batch,
``s`` = sequence length, ``s_e`` = ``s / tp`` for a sequence-parallel hidden-side entry,
else ``s``)::

    bytes(c) = e * b * sum_{x in sent(c)} s_x * numel_per_token(x)

The wire tensor is that rounded up to whole ``[b, hidden]`` rows. With interleaving,
Megatron uses one shape for every transition, so the wire is the largest transition's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, List, Optional, Tuple

from depthmix.planning.depth_plan import DepthPlan, Entry


@dataclass(frozen=True)
class PipelineLayout:
    num_layers: int
    pp: int = 1
    vp: int = 1

    def __post_init__(self):
        if self.num_layers % (self.pp * self.vp):
            raise ValueError(
                f"num_layers={self.num_layers} is not divisible by pp*vp={self.pp * self.vp}"
            )

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vp

    @property
    def layers_per_chunk(self) -> int:
        return self.num_layers // self.num_chunks

    def chunk(self, pp_rank: int, vp_stage: int = 0) -> int:
        return vp_stage * self.pp + pp_rank

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    def layers(self, chunk: int) -> range:
        """Global indices of the layers in ``chunk``."""
        start = chunk * self.layers_per_chunk
        return range(start, start + self.layers_per_chunk)

    def start(self, chunk: int) -> int:
        return chunk * self.layers_per_chunk

    def end(self, chunk: int) -> int:
        return (chunk + 1) * self.layers_per_chunk


@dataclass(frozen=True)
class Entering:
    """The entries live when a chunk starts, split by how they reach its rank."""

    sent: Tuple[Entry, ...]
    """Packed into the transition into the chunk (ordered by name)."""
    held: Tuple[Entry, ...]
    """Already on the rank: cached when it ran its previous chunk (``chunk - P``)."""


@dataclass(frozen=True)
class TransportGeometry:
    """Everything that fixes the size of a packed transition (known at start-up)."""

    plan: DepthPlan
    layout: PipelineLayout
    seq_length: int
    hidden_size: int
    tp: int = 1
    sequence_parallel: bool = False

    def seq_of(self, entry: Entry) -> int:
        if entry.seq_sharded and self.sequence_parallel:
            return self.seq_length // self.tp
        return self.seq_length

    @cached_property
    def _entering(self) -> Tuple[Entering, ...]:
        entering = []
        for chunk in range(self.layout.num_chunks):
            start = self.layout.start(chunk)
            prev_on_rank = chunk - self.layout.pp
            held_before = self.layout.end(prev_on_rank) if prev_on_rank >= 0 else None
            live = self.plan.live_at(start)
            # held: written before the rank's previous chunk ended (so it has it already)
            held = [e for e in live
                    if held_before is not None and e.version_at(start) < held_before]
            sent = [e for e in live if e not in held]
            entering.append(Entering(sent=tuple(sorted(sent, key=lambda e: e.name)),
                                     held=tuple(held)))
        return tuple(entering)

    def entering(self, chunk: int) -> Entering:
        """How the state live at ``chunk``'s first layer reaches its rank: the one split
        that sending, caching and receiving all read."""
        return self._entering[chunk]

    def sent_into(self, chunk: int) -> List[Entry]:
        """Entries the transition into ``chunk`` carries (ordered by name for packing)."""
        return list(self.entering(chunk).sent)

    def cached_after(self, chunk: int) -> List[Entry]:
        """Entries a rank keeps after running ``chunk`` for its next chunk ``chunk + P``:
        what that chunk holds on entry (anything written later arrives with the
        transition into ``chunk + P``)."""
        nxt = chunk + self.layout.pp
        if nxt >= self.layout.num_chunks:
            return []
        return list(self.entering(nxt).held)

    def numel_per_sample(self, entry: Entry) -> int:
        return self.seq_of(entry) * entry.numel_per_token

    @cached_property
    def _payload_numel(self) -> Tuple[int, ...]:
        return tuple(sum(self.numel_per_sample(e) for e in self.entering(c).sent)
                     for c in range(self.layout.num_chunks))

    def payload_numel_per_sample(self, chunk: int) -> int:
        return self._payload_numel[chunk]

    def rows(self, chunk: int) -> int:
        """Rows of the ``[rows, b, hidden]`` tensor entering ``chunk`` (any ``b``)."""
        return max(1, math.ceil(self.payload_numel_per_sample(chunk) / self.hidden_size))

    def wire_rows(self, chunk: int) -> int:
        """Rows actually exchanged: with interleaving Megatron uses one shape for all."""
        return self.max_rows() if self.layout.vp > 1 else self.rows(chunk)

    def max_rows(self) -> int:
        return max((self.rows(c) for c in range(1, self.layout.num_chunks)), default=1)

    def payload_bytes(self, chunk: int, micro_batch_size: int, element_size: int) -> int:
        return self.payload_numel_per_sample(chunk) * micro_batch_size * element_size

    def wire_bytes(self, chunk: int, micro_batch_size: int, element_size: int) -> int:
        return self.wire_rows(chunk) * micro_batch_size * self.hidden_size * element_size

    # ---- what Megatron's schedules need -------------------------------------------------
    def schedule_seq_length(self) -> int:
        """``seq_length`` to pass to the interleaved schedule: it derives the one P2P
        shape as ``[seq_length / tp (if SP), b, hidden]``."""
        rows = self.max_rows()
        return rows * (self.tp if self.sequence_parallel else 1)

    def adjust_tensor_shapes_fn(self, pp_rank: int, micro_batch_size: int):
        """For the non-interleaved schedule: exact per-transition shapes of this rank."""
        b, h = micro_batch_size, self.hidden_size
        recv = [(self.rows(pp_rank), b, h)] if pp_rank > 0 else None
        send = [(self.rows(pp_rank + 1), b, h)] if pp_rank + 1 < self.layout.pp else None

        def adjust(recv_shapes, send_shapes):
            return (recv or recv_shapes), (send or send_shapes)

        return adjust


def geometry_of(plan: Callable, config, layout: PipelineLayout,
                tp: Optional[int] = None) -> TransportGeometry:
    """The transport geometry of a model config on ``layout``, from its mixer's ``plan``
    (``Mixer.plan``: ``(config, tp) -> [Entry]``): the one constructor the model, the
    accounting, the dry run and the tools use."""
    tp = tp if tp is not None else config.tensor_model_parallel_size
    plan = DepthPlan(plan(config, tp), config.unrolled_layers)
    return TransportGeometry(plan=plan, layout=layout, seq_length=config.seq_length,
                             hidden_size=config.hidden_size, tp=tp,
                             sequence_parallel=config.sequence_parallel)
