"""KV-cached sampling from a single-rank (TP=PP=1) model (``depthmix-generate``:
:mod:`depthmix.cli.generate`).

The cache holds only sequence keys/values (Depth-Attention: its mixed values); all depth
reads are at the current token's own position and are recomputed in its forward.

Prompts of different lengths run in one batch left-padded (:func:`left_pad`): the
:class:`~depthmix.inference.kv_cache.KVCache` gives each row its own RoPE positions and
hides the padding from sequence attention (ShortSWA's window and MoDA's sequence part
included), and every depth read and residual operator is per token position, so no row's
tokens change with the batch it runs in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    Generators = Union[None, torch.Generator, Sequence[torch.Generator]]


def _full_vocab(logits: "Tensor", vocab_size: Optional[int]) -> "Tensor":
    return logits[..., :vocab_size] if vocab_size is not None else logits


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device=None
             ) -> Tuple["Tensor", "Tensor"]:
    """Token lists -> ``input_ids [b, longest]`` right-aligned after ``pad_id`` and the
    ``attention_mask`` (1 = real token) that :func:`generate` takes."""
    import torch

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _left_padding(attention_mask: "Tensor") -> "Tensor":
    """Padding length per row of a left-padded ``attention_mask [b, s]``."""
    import torch

    mask = attention_mask.bool()
    width = mask.shape[1]
    padding = width - mask.sum(dim=1)
    expected = torch.arange(width, device=mask.device)[None, :] >= padding[:, None]
    if not torch.equal(mask, expected):
        raise ValueError("attention_mask must be left padding: in every row all zeros come "
                         "before all ones")
    if bool((padding >= width).any()):
        raise ValueError("every row of attention_mask needs at least one real token")
    return padding


def sample_next(logits: "Tensor", temperature: float = 0.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: "Generators" = None) -> "Tensor":
    """The next token of each row from fp32 ``logits [b, v]``.

    ``temperature <= 0`` is greedy. Otherwise the logits are divided by the temperature,
    cut to the ``top_k`` largest and to the smallest set whose probability reaches
    ``top_p`` (the most likely token always stays), and sampled. ``generator`` is one
    generator for the batch or one per row (then a row's draws do not depend on the others).
    """
    import torch

    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        beyond = probs.cumsum(-1) - probs >= top_p  # the tokens before already reach top_p
        logits = logits.masked_fill(torch.zeros_like(beyond).scatter(-1, order, beyond),
                                    float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    if len(generator) != probs.shape[0]:
        raise ValueError(f"{len(generator)} generators for {probs.shape[0]} rows")
    return torch.cat([torch.multinomial(p[None], 1, generator=g)[0]
                      for p, g in zip(probs, generator)])


def generate(model, input_ids: "Tensor", max_new_tokens: int, temperature: float = 0.0,
             top_k: Optional[int] = None, eos_id: Optional[int] = None,
             vocab_size: Optional[int] = None, generator: "Generators" = None, *,
             top_p: Optional[float] = None, attention_mask: Optional["Tensor"] = None,
             on_token: Optional[Callable[["Tensor", "Tensor"], Optional["Tensor"]]] = None
             ) -> "Tensor":
    """Append up to ``max_new_tokens`` tokens to ``input_ids [b, s]``; returns ``[b, s + n]``.

    ``temperature=0`` is greedy (see :func:`sample_next` for ``top_k``/``top_p`` and
    ``generator``). ``vocab_size`` drops the padded logits of the embedding.
    ``attention_mask [b, s]`` (1 = real token) marks left padding, as :func:`left_pad`
    makes: each row then decodes exactly as it would alone. Once a row has produced
    ``eos_id`` it is filled with ``eos_id``; generation stops early when every row is done.
    ``on_token(token [b], done [b])`` is called after every step (streaming); it may
    return a bool ``[b]`` of rows to stop too (e.g. a stop string was produced).
    """
    import torch

    from depthmix.inference.kv_cache import KVCache

    padding = _left_padding(attention_mask) if attention_mask is not None else None
    model.eval()
    cache = KVCache(padding)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    new: List["Tensor"] = []
    with torch.no_grad():
        logits = model(input_ids, inference=cache)[:, -1]
        cache.advance(input_ids.shape[1])
        for step in range(max_new_tokens):
            token = sample_next(_full_vocab(logits.float(), vocab_size), temperature, top_k,
                                top_p, generator)
            if eos_id is not None:
                token = torch.where(done, torch.full_like(token, eos_id), token)
                done |= token == eos_id
            new.append(token)
            if on_token is not None:
                stop = on_token(token, done.clone())
                if stop is not None:
                    done |= stop.to(done.device)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            logits = model(token[:, None], inference=cache)[:, -1]
            cache.advance(1)
    if not new:
        return input_ids
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)


# ---------------------------------------------------------------------------------------
# depthmix-generate
# ---------------------------------------------------------------------------------------
