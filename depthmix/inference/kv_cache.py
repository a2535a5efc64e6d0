"""KV cache for incremental decoding.

Holds, per unrolled layer, the keys and values that sequence attention reads. Depth
mixers need no other persistent state: every depth read is at the query's own token
position, computed in the same forward. Depth-Attention stores its *mixed* values here
(in place of the raw ones), exactly as the paper's V-cache slot.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor


class KVCache:
    def __init__(self):
        self.keys: Dict[int, Tensor] = {}
        self.values: Dict[int, Tensor] = {}
        self.offset = 0
        """Number of tokens already cached (the position of the next token)."""

    def update(self, layer: int, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor]:
        """Append this forward's ``[s, b, ng, hn]`` keys/values; return all cached so far."""
        if layer in self.keys:
            key = torch.cat([self.keys[layer], key], dim=0)
            value = torch.cat([self.values[layer], value], dim=0)
        self.keys[layer], self.values[layer] = key, value
        return key, value

    def advance(self, num_tokens: int) -> None:
        """Call after each forward with the number of tokens it added."""
        self.offset += num_tokens
