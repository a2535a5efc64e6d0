"""The windows perplexity is computed over, and which rank evaluates which.

**Token stream.** A Megatron ``.bin/.idx`` dataset's documents concatenated in index order
(each ends with the end-of-document token that ``depthmix-preprocess`` appends), ``N``
tokens. Megatron's index writes the documents back to back from offset 0, so the stream is
the ``.bin`` file itself; :class:`TokenStream` maps it without copying.

**Windows.** With ``S = model.seq_length``, window ``i`` has inputs
``stream[i*S : i*S + S]`` and targets ``stream[i*S + 1 : i*S + S + 1]``: consecutive
windows share one token (the target shift) and every token but the first is predicted
exactly once, with the context since its window's start. There are ``ceil((N-1) / S)``
windows; when ``S`` does not divide ``N - 1`` the last one is partial and its missing
positions are padding with a zero loss mask (included, so no token is dropped). A dataset
with fewer than ``S + 1`` tokens (not one full window) is an error.

**Ranks.** Windows are taken in steps of ``G = dp * batch_size * num_microbatches``; in
step ``k``, micro-batch ``m`` of data-parallel rank ``r`` holds windows
``k*G + (m*dp + r)*batch_size + j`` for ``j < batch_size`` (Megatron's sampler order).
Positions past the last window are all-padding windows (loss mask 0), so every rank runs
the same number of steps and the result does not depend on the layout.
"""

from __future__ import annotations

import os
from typing import Dict, Iterator, List

import numpy as np
import torch

from depthmix.config.schema import ConfigError


class TokenStream:
    """The token stream of one dataset prefix (read-only memory map)."""

    def __init__(self, prefix: str, option: str):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        if not IndexedDataset.exists(prefix):
            raise ConfigError(f"{option}={prefix}: {prefix}.bin/.idx not found")
        dataset = IndexedDataset(prefix, mmap=True)
        size = int(dataset.sequence_lengths.sum(dtype=np.int64))
        expected = size * np.dtype(dataset.index.dtype).itemsize
        actual = os.path.getsize(f"{prefix}.bin")
        if actual < expected:
            raise ConfigError(f"{option}={prefix}: {prefix}.bin holds {actual} bytes, its "
                              f"index describes {expected} (truncated?)")
        self._dataset = dataset  # owns the memory map under ``tokens``: keep it open
        self.tokens = dataset.bin_reader.read(dtype=dataset.index.dtype, count=size, offset=0)
        self.documents = len(dataset)

    def __len__(self) -> int:
        return len(self.tokens)

    def max_token(self, chunk: int = 1 << 26) -> int:
        return max(int(self.tokens[i:i + chunk].max()) for i in range(0, len(self), chunk))


def num_windows(num_tokens: int, seq_length: int) -> int:
    """``ceil((N - 1) / S)``: full windows plus a partial last one."""
    return -(-(num_tokens - 1) // seq_length)


def window(tokens: np.ndarray, index: int, seq_length: int) -> Dict[str, torch.Tensor]:
    """Inputs, targets and loss mask (``[S]`` each) of window ``index``; padding past the
    end of the stream (and for indices past the last window) has mask 0 and token 0."""
    start = index * seq_length
    piece = np.asarray(tokens[start:start + seq_length + 1], dtype=np.int64)
    n = max(len(piece) - 1, 0)  # predicted positions
    inputs = np.zeros(seq_length, dtype=np.int64)
    targets = np.zeros(seq_length, dtype=np.int64)
    inputs[:min(len(piece), seq_length)] = piece[:seq_length]
    targets[:n] = piece[1:]
    mask = np.zeros(seq_length, dtype=np.float32)
    mask[:n] = 1.0
    return {"tokens": torch.from_numpy(inputs), "labels": torch.from_numpy(targets),
            "loss_mask": torch.from_numpy(mask)}


def steps(total_windows: int, dp: int, batch_size: int, num_microbatches: int) -> int:
    per_step = dp * batch_size * num_microbatches
    return -(-total_windows // per_step)


def microbatches(tokens: np.ndarray, total_windows: int, seq_length: int, step: int,
                 dp_rank: int, dp: int, batch_size: int,
                 num_microbatches: int) -> List[Dict[str, torch.Tensor]]:
    """The micro-batches of one step for data-parallel rank ``dp_rank`` (module docstring)."""
    out = []
    first = step * dp * batch_size * num_microbatches
    for m in range(num_microbatches):
        start = first + (m * dp + dp_rank) * batch_size
        rows = [window(tokens if i < total_windows else tokens[:0], i, seq_length)
                for i in range(start, start + batch_size)]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        batch["position_ids"] = torch.arange(seq_length).repeat(batch_size, 1)
        out.append(batch)
    return out


def all_windows(tokens: np.ndarray, total_windows: int, seq_length: int) -> Iterator[dict]:
    """Every window in order (single-process references and tests)."""
    for i in range(total_windows):
        yield window(tokens, i, seq_length)
