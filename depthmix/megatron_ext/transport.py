"""Pipeline transport of depth state: the one place that moves it between stages.

Megatron's schedules exchange one fixed-shape ``[rows, micro_batch, hidden]`` tensor per
stage transition. We pack the entries a transition must carry into that tensor (flat,
one after another, zero padded to whole rows) and unpack them on the other side, so the
forward values and, through autograd, their gradients travel with the activations.

What a transition into chunk ``c`` carries (``P`` pipeline ranks, ``c - P`` the chunk the
receiving rank ran before ``c``): every entry live at ``c``'s first layer whose current
version was written at or after the end of chunk ``c - P``. Anything older the receiving
rank already holds: it either produced it or received it when entering ``c - P``. Each
rank therefore keeps a per-micro-batch cache of the entries its later chunks will read
(Block AttnRes' cross-stage caching, applied to every mixer); without interleaving
(``V = 1``) there is no earlier chunk on the receiver and everything live is sent.

Gradients of cached entries: a later chunk reads a cached tensor through a detached leaf;
its gradient is handed to the producing chunk's backward by :class:`_InjectCachedGrads`,
which sits on that chunk's output. Megatron runs chunk ``c + P``'s backward before chunk
``c``'s (the latter needs the gradient of the former's input), so the leaf's gradient is
complete when it is read.

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
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from depthmix.planning.depth_plan import DepthPlan, DepthState, Entry
from depthmix.planning.pipeline import PipelineLayout


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


def geometry_of(config, layout: PipelineLayout, tp: Optional[int] = None) -> TransportGeometry:
    """The transport geometry of a model config (its mixer's plan) on ``layout``: the one
    constructor the model, the accounting, the dry run and the tools use."""
    from depthmix.mixers import get_mixer

    tp = tp if tp is not None else config.tensor_model_parallel_size
    plan = DepthPlan(get_mixer(config.mixer.name).plan(config, tp), config.unrolled_layers)
    return TransportGeometry(plan=plan, layout=layout, seq_length=config.seq_length,
                             hidden_size=config.hidden_size, tp=tp,
                             sequence_parallel=config.sequence_parallel)


class _Slot:
    """A cached entry of one micro-batch and the leaves later chunks read it through."""

    __slots__ = ("tensor", "leaves")

    def __init__(self, tensor: Tensor):
        self.tensor = tensor
        self.leaves: List[Tensor] = []

    def leaf(self) -> Tensor:
        if not (torch.is_grad_enabled() and self.tensor.requires_grad):
            return self.tensor.detach()
        leaf = self.tensor.detach().requires_grad_(True)
        self.leaves.append(leaf)
        return leaf

    def take_grad(self) -> Optional[Tensor]:
        grads = [leaf.grad for leaf in self.leaves if leaf.grad is not None]
        self.leaves = []
        self.tensor = None
        if not grads:
            return None
        return grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)


class DepthStateCache:
    """Per-rank cache of depth-state entries, shared by the rank's model chunks."""

    def __init__(self):
        self._slots: Dict[int, Dict[str, _Slot]] = {}

    def reset(self) -> None:
        """Drop everything (call once before each forward-backward pass)."""
        self._slots.clear()

    def put(self, microbatch: int, name: str, tensor: Tensor) -> _Slot:
        slot = _Slot(tensor)
        self._slots.setdefault(microbatch, {})[name] = slot
        return slot

    def get(self, microbatch: int, name: str) -> _Slot:
        try:
            return self._slots[microbatch][name]
        except KeyError as e:
            raise RuntimeError(
                f"depth-state entry {name!r} of micro-batch {microbatch} is neither "
                "received nor cached on this rank (was the cache reset mid-step?)"
            ) from e

    def __len__(self) -> int:
        return sum(len(v) for v in self._slots.values())


class _InjectCachedGrads(torch.autograd.Function):
    """Identity on ``carrier``; in backward, returns the cached entries' leaf gradients."""

    @staticmethod
    def forward(ctx, slots, carrier, *cached):
        ctx.slots = slots
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad_carrier):
        return (None, grad_carrier, *[slot.take_grad() for slot in ctx.slots])


class DepthTransport:
    """Packs, sends, caches and unpacks depth state for one model chunk."""

    def __init__(self, geometry: TransportGeometry, chunk: int, cache: DepthStateCache):
        self.geo = geometry
        self.chunk = chunk
        self.cache = cache
        self.bytes_sent = 0
        """Payload bytes this chunk has packed for sending (for tests and logging)."""

    def _shape(self, entry: Entry, micro_batch: int) -> tuple:
        return (self.geo.seq_of(entry), micro_batch, *entry.shape)

    def receive(self, packed: Tensor, microbatch: int) -> DepthState:
        """State entering this chunk: unpacked new entries plus this rank's cached ones."""
        micro_batch = packed.shape[1]
        flat = packed.reshape(-1)
        state: DepthState = {}
        offset = 0
        entering = self.geo.entering(self.chunk)
        for entry in entering.sent:
            shape = self._shape(entry, micro_batch)
            n = math.prod(shape)
            state[entry.name] = flat[offset : offset + n].view(shape)
            offset += n
        for entry in entering.held:
            state[entry.name] = self.cache.get(microbatch, entry.name).leaf()
        return state

    def send(self, state: DepthState, microbatch: int) -> Tensor:
        """Pack what the next chunk needs; cache what this rank's next chunk needs."""
        sent = self.geo.sent_into(self.chunk + 1)
        pieces = [state[e.name] for e in sent]
        slots, cached = [], []
        for entry in self.geo.cached_after(self.chunk):
            tensor = state[entry.name]
            slots.append(self.cache.put(microbatch, entry.name, tensor))
            cached.append(tensor)
        if cached and torch.is_grad_enabled():
            pieces[0] = _InjectCachedGrads.apply(slots, pieces[0], *cached)

        micro_batch = pieces[0].shape[1]
        rows = self.geo.wire_rows(self.chunk + 1)
        out = pieces[0].new_zeros(rows, micro_batch, self.geo.hidden_size)
        flat = out.view(-1)
        offset = 0
        for piece in pieces:
            n = piece.numel()
            flat[offset : offset + n].copy_(piece.reshape(-1))
            offset += n
        self.bytes_sent += offset * out.element_size()
        return out
