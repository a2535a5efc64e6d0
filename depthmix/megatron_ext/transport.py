"""Pipeline transport of depth state: the one place that moves it between stages.

Megatron's schedules exchange one fixed-shape ``[rows, micro_batch, hidden]`` tensor per
stage transition. We pack the entries a transition must carry into that tensor (flat,
one after another, zero padded to whole rows) and unpack them on the other side, so the
forward values and, through autograd, their gradients travel with the activations. What
each transition carries, and its size, is the :class:`~depthmix.planning.pipeline.
TransportGeometry`; the entries a rank already holds it keeps in a per-micro-batch cache
for its later chunks (Block AttnRes' cross-stage caching, applied to every mixer).

Gradients of cached entries: a later chunk reads a cached tensor through a detached leaf;
its gradient is handed to the producing chunk's backward by :class:`_InjectCachedGrads`,
which sits on that chunk's output. Megatron runs chunk ``c + P``'s backward before chunk
``c``'s (the latter needs the gradient of the former's input), so the leaf's gradient is
complete when it is read.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch import Tensor

from depthmix.planning.depth_plan import DepthState, Entry
from depthmix.planning.pipeline import TransportGeometry


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
