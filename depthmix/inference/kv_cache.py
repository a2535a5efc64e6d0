"""KV cache for incremental decoding.

Holds, per unrolled layer, the keys and values that sequence attention reads. Depth
mixers need no other persistent state: every depth read is at the query's own token
position, computed in the same forward. Depth-Attention stores its *mixed* values here
(in place of the raw ones), exactly as the paper's V-cache slot.

Batched prompts of different lengths are left-padded: the cache then knows each row's
padding and hands the model per-row positions (RoPE) and a key mask that hides the padding
from every real query. Depth reads and all residual operators are per token position, so
padding positions (whose hidden states are garbage) never reach a real row.
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
    def __init__(self, padding: Optional[Tensor] = None):
        self.keys: Dict[Hashable, Tensor] = {}
        self.values: Dict[Hashable, Tensor] = {}
        self.offset = 0
        """Number of token slots already cached (the slot of the next token)."""
        self.padding = padding if padding is not None and bool(padding.any()) else None
        """Left-padding length of each row ``[b]``, or None when no row is padded."""
        self.counters: Dict[str, int] = {}
        """Work counters kept by some mixers for benchmarks, summed over forwards (AttnRes:
        ``attnres/source_reads``, depth-source vectors read per token, see
        ``docs/methods/attnres.md``)."""

    def positions(self, seq_len: int) -> Optional[Tensor]:
        """Per-row positions ``[b, seq_len]`` of this forward's tokens (a row's first real
        token is at position 0; padding slots get 0), or None without padding."""
        if self.padding is None:
            return None
        slots = torch.arange(self.offset, self.offset + seq_len, device=self.padding.device)
        return (slots[None, :] - self.padding[:, None]).clamp(min=0)

    def attention_mask(self, num_queries: int, num_keys: int) -> Optional[Tensor]:
        """Which keys each query may see, ``[b, 1, sq, sk]`` (True = visible), or None
        without padding (plain causal attention).

        The ``num_queries`` queries are this forward's tokens; the ``num_keys`` keys are
        the last ones up to and including them (a windowed cache keeps fewer). A key is
        visible when it is causal and not padding; a padding query also sees itself, so
        no softmax row is empty (its output is never read by a real token).
        """
        if self.padding is None:
            return None
        end = self.offset + num_queries
        device = self.padding.device
        q = torch.arange(self.offset, end, device=device)[:, None]  # [sq, 1] slots
        k = torch.arange(end - num_keys, end, device=device)[None, :]  # [1, sk] slots
        real = k[None] >= self.padding[:, None, None]  # [b, 1, sk]
        mask = (k <= q)[None] & (real | (k == q)[None])  # [b, sq, sk]
        return mask[:, None]

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
