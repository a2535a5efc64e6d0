"""Train/validation data for one data-parallel rank, on Megatron-Core's GPTDataset.

:func:`build_data` is what the trainer calls::

    data = build_data(run, dp_rank, dp_size, consumed_train_samples)
    batch = next(data.train_iterator)      # dict of [micro_batch_size, seq_length] CPU tensors
    for batch in data.valid_iterator(): ...

How samples are laid out
------------------------
Megatron's ``BlendedMegatronDatasetBuilder`` builds a ``GPTDataset`` per prefix and split
(documents shuffled, packed into ``seq_length + 1`` token windows, windows shuffled; all
seeded by ``train.seed``) and, for several prefixes, a ``BlendedDataset`` over them. The
result is one sequence of *global samples* ``0, 1, 2, ...``. Step ``k`` trains on global
samples ``[k*G, (k+1)*G)`` (``G = train.global_batch_size``); inside a step they are cut
into chunks of ``micro_batch_size * dp_size`` and each chunk is split contiguously across
the data-parallel ranks (Megatron's ``MegatronPretrainingSampler``). So every DP size sees
the same samples in each step, and starting at ``consumed_train_samples`` resumes the exact
data position. The train iterator is infinite: past the ``train.steps * G`` samples that
were built it wraps around.

Validation uses the same ``eval_iters * G`` validation samples at every evaluation
(``valid_iterator()`` starts afresh each call), so validation losses of one run, and of
runs with the same data, are directly comparable.

Caches
------
Everything is written under the cache directory (:func:`cache_dir`): the embedded corpus,
its tokenizer and ``.bin/.idx`` under ``embedded/<key>/``, and GPTDataset/BlendedDataset
index files under ``indices/``. Runs with the same data, seed, sequence length and sample
counts reuse them. With several nodes the cache directory must be on a shared filesystem
(rank 0 writes the index files, the other ranks read them), as in Megatron.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from filelock import FileLock

from depthmix.config.schema import RunConfig
from depthmix.config.validate import parse_blend  # noqa: F401  (re-exported)
from depthmix.data.tokenizer import HFTokenizer, load_tokenizer  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

EMBEDDED_SEED = 0
"""Seed of the embedded corpus. Fixed (not ``train.seed``): runs with different training
seeds train on the same text, only in a different order."""

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


# ------------------------------------------------------------------------ paths and locks
def default_cache_dir() -> str:
    """``$DEPTHMIX_CACHE_DIR``, else ``$XDG_CACHE_HOME/depthmix``, else ``~/.cache/depthmix``."""
    if os.environ.get("DEPTHMIX_CACHE_DIR"):
        return os.environ["DEPTHMIX_CACHE_DIR"]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "depthmix")


def cache_dir(run: RunConfig) -> str:
    """``data.cache_dir`` if set, else :func:`default_cache_dir`. Shared by all runs on
    purpose: the embedded corpus and index caches do not depend on the run's output dir."""
    return os.path.abspath(os.path.expanduser(run.data.cache_dir or default_cache_dir()))


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _single_process_world():
    """A throw-away gloo world of one process (in-memory store, no ports).

    megatron-core 0.16.1's ``BlendedDataset._build_indices`` calls
    ``torch.distributed.get_rank()`` without checking that a process group exists (its
    GPTDataset does check), so blends fail in a plain process. This lends it one.
    """
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                         rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------ embedded corpus
@dataclass
class EmbeddedPaths:
    directory: str
    corpus: str
    tokenizer: str
    prefix: str


def embedded_paths(root: str, num_documents: int, vocab_size: int) -> EmbeddedPaths:
    from depthmix.data.corpus import GENERATOR_VERSION

    key = f"v{GENERATOR_VERSION}-docs{num_documents}-vocab{vocab_size}-seed{EMBEDDED_SEED}"
    d = os.path.join(root, "embedded", key)
    return EmbeddedPaths(d, os.path.join(d, "corpus.jsonl"), os.path.join(d, "tokenizer.json"),
                         os.path.join(d, "text_document"))


def _build_embedded_locked(paths: EmbeddedPaths, num_documents: int, vocab_size: int) -> None:
    done = os.path.join(paths.directory, "COMPLETE")
    if os.path.exists(done):
        return
    with FileLock(paths.directory + ".lock"):
        if os.path.exists(done):  # another process built it while we waited
            return
        import json

        from depthmix.data.corpus import write_corpus
        from depthmix.data.preprocess import preprocess
        from depthmix.data.tokenizer import train_bpe_tokenizer

        t0 = time.time()
        write_corpus(paths.corpus, num_documents, seed=EMBEDDED_SEED)
        with open(paths.corpus, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        train_bpe_tokenizer(texts, vocab_size, paths.tokenizer)
        stats = preprocess([paths.corpus], paths.tokenizer, paths.prefix, workers=1,
                           progress=False)
        with open(done, "w") as f:
            f.write(f"documents={stats.documents} tokens={stats.tokens}\n")
        logger.info("built the embedded corpus in %s: %d documents, %d tokens (%.1f s)",
                    paths.directory, stats.documents, stats.tokens, time.time() - t0)


def prepare_embedded(run: RunConfig) -> EmbeddedPaths:
    """Generate the embedded corpus, its tokenizer and ``.bin/.idx`` once (cached).

    Safe when several processes call it at once: with a process group, rank 0 builds
    and the others wait at a barrier; without one, a file lock serialises them. A rank
    that still finds nothing after the barrier (node-local cache) builds its own copy.
    """
    d = run.data  # options checked by depthmix.config.validate.validate_data
    paths = embedded_paths(cache_dir(run), d.embedded_documents, d.embedded_vocab_size)
    if _distributed():
        if torch.distributed.get_rank() == 0:
            _build_embedded_locked(paths, d.embedded_documents, d.embedded_vocab_size)
        torch.distributed.barrier()
    _build_embedded_locked(paths, d.embedded_documents, d.embedded_vocab_size)
    return paths


# ------------------------------------------------------------------------ blends
def _check_prefixes(paths: list[str], weighted: bool, tokenizer: HFTokenizer) -> list[str]:
    """Absolute prefixes, each checked by :func:`~depthmix.data.index_file.check_prefix`.

    Every rank runs the constant-time checks; the pass over each ``.idx`` and the token-id
    sample run once (rank 0, or the only process)."""
    from depthmix.data.index_file import check_prefix

    deep = not _distributed() or torch.distributed.get_rank() == 0
    out = []
    for i, p in enumerate(paths):
        p = os.path.abspath(os.path.expanduser(p))
        option = f"data.prefixes[{2 * i + 1 if weighted else i}]"
        check_prefix(p, option, tokenizer.vocab_size, deep=deep,
                     vocab_source="data.tokenizer")
        out.append(p)
    return out


# ------------------------------------------------------------------------ batches
class PretrainingBatchSampler:
    """Index lists of one DP rank's micro-batches (Megatron's pretraining sampler order).

    Global samples are consumed in chunks of ``micro_batch_size * dp_size`` starting at
    ``consumed_samples``; rank ``r`` takes ``[r*mbs, (r+1)*mbs)`` of each chunk. Indices
    wrap modulo ``total_samples``. ``num_micro_batches=None`` means infinite.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, num_micro_batches: Optional[int] = None):
        if total_samples < 1:
            raise ValueError("the dataset has no samples")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if consumed_samples % (micro_batch_size * dp_size):
            raise ValueError(f"consumed_train_samples={consumed_samples} is not a multiple of "
                             f"micro_batch_size * dp_size = {micro_batch_size} * {dp_size}")
        self.total = total_samples
        self.consumed = consumed_samples
        self.mbs = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_micro_batches = num_micro_batches

    def __len__(self) -> int:
        if self.num_micro_batches is None:
            raise TypeError("infinite sampler")
        return self.num_micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed
        count = 0
        while self.num_micro_batches is None or count < self.num_micro_batches:
            lo = start + self.dp_rank * self.mbs
            yield [(lo + j) % self.total for j in range(self.mbs)]
            start += self.mbs * self.dp_size
            count += 1


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack GPTDataset samples into ``[b, s]`` tensors (ints int64, loss_mask float32)."""
    return {
        "tokens": torch.stack([s["tokens"] for s in samples]).long(),
        "labels": torch.stack([s["labels"] for s in samples]).long(),
        "loss_mask": torch.stack([s["loss_mask"] for s in samples]).float(),
        "position_ids": torch.stack([s["position_ids"] for s in samples]).long(),
    }


def _loader(dataset, sampler: PretrainingBatchSampler, num_workers: int):
    # its own generator: creating an iterator draws a seed, which from torch's global one
    # would shift the RNG state a resumed run restored (it then differs from an
    # uninterrupted run's)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                       num_workers=num_workers, generator=torch.Generator(),
                                       persistent_workers=num_workers > 0)


# ------------------------------------------------------------------------ the bundle
@dataclass
class Data:
    """What :func:`build_data` returns: the tokenizer and this rank's iterators."""

    tokenizer: HFTokenizer
    train_iterator: Iterator[dict[str, torch.Tensor]]
    train_dataset: Any
    valid_dataset: Any
    test_dataset: Any
    micro_batch_size: int
    num_micro_batches: int
    """Micro-batches per step on this rank: global_batch / (micro_batch * dp_size)."""
    eval_iters: int
    dp_rank: int
    dp_size: int
    num_workers: int = 0
    prefixes: list[str] = field(default_factory=list)
    weights: Optional[list[float]] = None

    def _eval_iterator(self, dataset) -> Iterator[dict[str, torch.Tensor]]:
        if dataset is None or self.eval_iters < 1:
            return iter(())
        n = self.eval_iters * self.num_micro_batches
        sampler = PretrainingBatchSampler(len(dataset), 0, self.micro_batch_size,
                                          self.dp_rank, self.dp_size, num_micro_batches=n)
        return iter(_loader(dataset, sampler, self.num_workers))

    def valid_iterator(self) -> Iterator[dict[str, torch.Tensor]]:
        """A fresh, finite iterator: ``eval_iters * num_micro_batches`` micro-batches of
        this rank, the same validation samples at every call. Empty without a valid split."""
        return self._eval_iterator(self.valid_dataset)

    def test_iterator(self) -> Iterator[dict[str, torch.Tensor]]:
        """Like :meth:`valid_iterator` over the test split (empty when it has weight 0)."""
        return self._eval_iterator(self.test_dataset)


def build_data(run: RunConfig, dp_rank: int, dp_size: int, consumed_train_samples: int = 0
               ) -> Data:
    """Tokenizer, train iterator and validation iterators for data-parallel rank ``dp_rank``.

    Collective when ``torch.distributed`` is initialised: every rank of the default group
    must call it (Megatron's dataset builder synchronises on barriers). Without a process
    group it works in a plain process (tests, notebooks).
    """
    d, t = run.data, run.train
    mbs, gbs = t.micro_batch_size, t.global_batch_size
    if consumed_train_samples < 0:
        raise ValueError(f"consumed_train_samples={consumed_train_samples} must be >= 0")

    if d.prefixes:
        paths, weights = parse_blend(d.prefixes)
        tokenizer = load_tokenizer(d.tokenizer, "data.tokenizer", run.model.vocab_size)
        paths = _check_prefixes(paths, weights is not None, tokenizer)
    else:
        emb = prepare_embedded(run)
        paths, weights = [emb.prefix], None
        tokenizer = load_tokenizer(emb.tokenizer, "data.embedded_vocab_size (the embedded "
                                   "tokenizer)", run.model.vocab_size)

    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    root = cache_dir(run)
    config = GPTDatasetConfig(
        random_seed=t.seed,
        sequence_length=run.model.seq_length,
        blend=(paths, weights),
        split=d.split,
        path_to_cache=os.path.join(root, "indices"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,  # the model builds its causal mask itself
    )
    eval_samples = max(t.eval_iters, 1) * gbs
    sizes = [t.steps * gbs, eval_samples, eval_samples]
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    t0 = time.time()
    if _distributed():
        train_ds, valid_ds, test_ds = builder.build()  # rank 0 first, then a barrier
    else:
        blended = len(paths) > 1 or weights is not None
        with FileLock(os.path.join(root, "indices.lock")), (
                _single_process_world() if blended else contextlib.nullcontext()):
            train_ds, valid_ds, test_ds = builder.build()
    logger.info("datasets built in %.2f s: train %d, valid %s, test %s samples",
                time.time() - t0, len(train_ds),
                None if valid_ds is None else len(valid_ds),
                None if test_ds is None else len(test_ds))

    sampler = PretrainingBatchSampler(len(train_ds), consumed_train_samples, mbs, dp_rank,
                                      dp_size)
    return Data(
        tokenizer=tokenizer,
        train_iterator=iter(_loader(train_ds, sampler, d.num_workers)),
        train_dataset=train_ds,
        valid_dataset=valid_ds,
        test_dataset=test_ds,
        micro_batch_size=mbs,
        num_micro_batches=gbs // (mbs * dp_size),
        eval_iters=t.eval_iters,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=d.num_workers,
        prefixes=paths,
        weights=weights,
    )
