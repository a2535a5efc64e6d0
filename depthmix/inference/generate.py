"""KV-cached sampling from a single-rank (TP=PP=1) model; every mixer supports it.

The cache holds only sequence keys/values (Depth-Attention: its mixed values); all depth
reads are at the current token's own position and are recomputed in its forward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from depthmix.inference.kv_cache import KVCache


def _full_vocab(logits: Tensor, vocab_size: Optional[int]) -> Tensor:
    return logits[..., :vocab_size] if vocab_size is not None else logits


@torch.no_grad()
def generate(model, input_ids: Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: Optional[int] = None, eos_id: Optional[int] = None,
             vocab_size: Optional[int] = None, generator: Optional[torch.Generator] = None
             ) -> Tensor:
    """Append up to ``max_new_tokens`` tokens to ``input_ids [b, s]``.

    ``temperature=0`` is greedy. ``vocab_size`` drops the padded logits of the embedding.
    Generation stops early once every row has produced ``eos_id``.
    """
    model.eval()
    cache = KVCache()
    logits = model(input_ids, inference=cache)[:, -1]
    cache.advance(input_ids.shape[1])
    out = input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = _full_vocab(logits.float(), vocab_size)
        if temperature <= 0:
            token = logits.argmax(-1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
        if eos_id is not None:
            token = torch.where(done, torch.full_like(token, eos_id), token)
            done |= token == eos_id
        out = torch.cat([out, token[:, None]], dim=1)
        if eos_id is not None and bool(done.all()):
            break
        logits = model(token[:, None], inference=cache)[:, -1]
        cache.advance(1)
    return out
