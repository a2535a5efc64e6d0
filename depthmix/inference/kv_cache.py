"""KV cache for incremental decoding.

Holds, per unrolled layer, the keys and values that sequence attention reads. Depth
mixers need no other persistent state: every depth read is at the query's own token
position, computed in the same forward. Depth-Attention stores its *mixed* values here
(in place of the raw ones), exactly as the paper's V-cache slot.
"""

from __future__ import annotations

from typing import Dict, Hashable, Optional, Tuple

import torch
from torch import Tensor


def _owning(t: Tensor) -> Tensor:
    """``t`` itself if it owns its storage, else a copy: a view (e.g. the value slice of the
    fused QKV projection) would keep its whole base tensor alive in the cache."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


class KVCache:
    def __init__(self):
        self.keys: Dict[Hashable, Tensor] = {}
        self.values: Dict[Hashable, Tensor] = {}
        self.offset = 0
        """Number of tokens already cached (the position of the next token)."""
        self.counters: Dict[str, int] = {}
        """Work counters kept by some mixers for benchmarks, summed over forwards (AttnRes:
        ``attnres/source_reads``, depth-source vectors read per token, see
        ``docs/methods/attnres.md``)."""

    def update(self, layer: Hashable, key: Tensor, value: Tensor,
               keep: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        """Append this forward's ``[s, b, ng, hn]`` keys/values; return all cached so far.

        ``layer``: the unrolled layer index for the layer's sequence attention, or a
        namespaced key such as ``("swa", layer)`` for another attention in that layer.
        ``keep``: afterwards store only the last ``keep`` positions (a sliding window of
        ``w`` needs ``w - 1``); None keeps everything.
        """
        if layer in self.keys:
            key = torch.cat([self.keys[layer], key], dim=0)
            value = torch.cat([self.values[layer], value], dim=0)
        else:
            key, value = _owning(key), _owning(value)
        if keep is None:
            self.keys[layer], self.values[layer] = key, value
        else:
            start = max(0, key.shape[0] - keep)
            self.keys[layer], self.values[layer] = key[start:], value[start:]
        return key, value

    def count(self, name: str, amount: int) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def advance(self, num_tokens: int) -> None:
        """Call after each forward with the number of tokens it added."""
        self.offset += num_tokens
