"""Data for depthmix: the embedded corpus, tokenizers, preprocessing and GPT datasets.

* :func:`build_data` (``datasets.py``) - the trainer's entry point: tokenizer and the
  train/validation micro-batch iterators of one data-parallel rank.
* ``depthmix-preprocess`` (``preprocess.py``) - jsonl/jsonl.zst -> Megatron ``.bin/.idx``
  (one prefix per domain with ``--split-by``).
* :func:`~depthmix.data.index_file.check_prefix` (``integrity.py``) - is a ``.bin/.idx``
  pair whole and consistent; read from the files, without Megatron.
* :class:`HFTokenizer` (``tokenizer.py``) - a ``tokenizers`` JSON file with the interface
  Megatron's GPTDataset and the trainer use.
* ``corpus.py`` - the procedurally generated English corpus used when no data is given.

Names are imported lazily so that preprocessing workers do not import torch/Megatron.
"""

from __future__ import annotations

__all__ = ["build_data", "Data", "HFTokenizer", "train_bpe_tokenizer"]


def __getattr__(name: str):
    if name in ("build_data", "Data"):
        from depthmix.data import datasets

        return getattr(datasets, name)
    if name in ("HFTokenizer", "train_bpe_tokenizer"):
        from depthmix.data import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module 'depthmix.data' has no attribute {name!r}")
