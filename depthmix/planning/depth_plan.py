"""The depth state a layer hands to the next, and its static plan.

A decoder layer reads and writes a *depth state*: a dict of named tensors. Vanilla holds
one entry, the residual stream ``h``. Depth mixers add their own (Depth-Attention: the
source layers' keys and mixed values; Full AttnRes: every sublayer output; mHC: the
``n`` widened streams, ...). Each entry is ``[seq, micro_batch, *shape]``.

The :class:`DepthPlan` says, per entry, which layers write it and which read it. It is
known at start-up, and everything that must not be guessed at run time derives from it:
which entries are still needed at a layer boundary, what a pipeline stage transition
sends, what a rank caches, and how many bytes that costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterable, Optional

if TYPE_CHECKING:
    from torch import Tensor

DepthState = Dict[str, "Tensor"]

HIDDEN = "h"
"""Depth-state name of the ordinary residual stream."""

STEM = -1
"""Writer index of the embedding stem (before layer 0)."""


@dataclass(frozen=True)
class Entry:
    """One named tensor of the depth state.

    ``writers``: global layer indices that (re)write it, ``STEM`` for the embedding.
    ``readers``: global layer indices that read it; ``num_layers`` means the LM head.
    Within a layer, reads happen before writes (vanilla reads ``h`` and writes a new ``h``).
    ``shape``: per-token trailing shape on one rank (e.g. ``(hidden,)`` or
    ``(kv_heads_local, head_dim)``). ``seq_sharded``: the entry lives on the
    sequence-parallel shard (hidden-side state) rather than the full sequence
    (attention-side state at the rank's local heads).
    """

    name: str
    writers: tuple
    readers: tuple
    shape: tuple
    seq_sharded: bool = True

    def version_at(self, boundary: int) -> Optional[int]:
        """The writer of the value visible when entering layer ``boundary``."""
        earlier = [w for w in self.writers if w < boundary]
        return max(earlier) if earlier else None

    def live_at(self, boundary: int) -> bool:
        """Whether the value visible at ``boundary`` is read at or after it."""
        if self.version_at(boundary) is None:
            return False
        next_read = min((r for r in self.readers if r >= boundary), default=None)
        next_write = min((w for w in self.writers if w >= boundary), default=None)
        return next_read is not None and (next_write is None or next_read <= next_write)

    @property
    def numel_per_token(self) -> int:
        return math.prod(self.shape)


class DepthPlan:
    """All entries of a model's depth state over the (unrolled) layer sequence."""

    def __init__(self, entries: Iterable[Entry], num_layers: int):
        self.entries = {e.name: e for e in entries}
        self.num_layers = num_layers
        self._live = {
            p: [e for e in self.entries.values() if e.live_at(p)] for p in range(num_layers + 1)
        }
        self._live_names = {p: frozenset(e.name for e in live) for p, live in self._live.items()}

    def live_at(self, boundary: int) -> list:
        """Entries needed when entering layer ``boundary`` (``num_layers`` = the head)."""
        return self._live[boundary]

    def live_names(self, boundary: int) -> frozenset:
        return self._live_names[boundary]

    def __getitem__(self, name: str) -> Entry:
        return self.entries[name]

    def __repr__(self) -> str:
        return f"DepthPlan({list(self.entries)}, num_layers={self.num_layers})"
