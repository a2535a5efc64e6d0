"""The data options' start-up checks (run by the trainer's preflight and the dry run, before
any process group exists): nothing is built and nothing imports torch or Megatron.

* the embedded corpus' vocabulary fits ``model.vocab_size``;
* every ``data.prefixes`` entry has its ``.bin``/``.idx`` and passes
  :func:`~depthmix.data.index_file.check_prefix`'s constant-time checks;
* ``data.split`` gives every split with a positive weight at least one document (Megatron
  would loop for ever);
* ``data.tokenizer`` loads and its vocabulary fits ``model.vocab_size``.
"""

from __future__ import annotations

import os
from typing import List, Optional

from depthmix.config.schema import ConfigError, RunConfig
from depthmix.config.validate import parse_blend, split_weights
from depthmix.data.index_file import check_prefix
from depthmix.data.tokenizer import load_tokenizer

SPLITS = ("train", "valid", "test")


def split_ranges(split: str, num_documents: int) -> List[Optional[range]]:
    """Documents of each of train/valid/test as Megatron cuts them (None: weight 0)."""
    weights = split_weights(split)
    out, start = [], 0.0
    for w in weights:
        if w <= 0:
            out.append(None)
        else:
            end = min(start + w, 1.0)
            out.append(range(int(round(start * num_documents)), int(round(end * num_documents))))
        start += w
    return out


def _check_split(split: str, source: str, num_documents: int) -> None:
    for name, docs in zip(SPLITS, split_ranges(split, num_documents)):
        if docs is not None and len(docs) == 0:
            raise ConfigError(f"data.split={split!r} gives the {name} split of {source} no "
                              f"documents ({num_documents} documents in all)")


def check_data(run: RunConfig) -> None:
    d = run.data
    if not d.prefixes:  # the embedded corpus: built at start-up, its sizes are options
        if d.embedded_vocab_size > run.model.vocab_size:
            raise ConfigError(f"data.embedded_vocab_size={d.embedded_vocab_size} is larger "
                              f"than model.vocab_size={run.model.vocab_size}")
        _check_split(d.split, "the embedded corpus (data.embedded_documents)",
                     d.embedded_documents)
        return
    paths, weights = parse_blend(d.prefixes)
    for i, path in enumerate(paths):
        prefix = os.path.abspath(os.path.expanduser(path))
        if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
            raise ConfigError(f"data.prefixes: {prefix}.bin/.idx not found "
                              "(make them with depthmix-preprocess)")
        # header, sizes and index consistency (the pass over every document: build_data)
        info = check_prefix(prefix, f"data.prefixes[{2 * i + 1 if weights else i}]", deep=False)
        _check_split(d.split, prefix, info.sequences)
    load_tokenizer(d.tokenizer, "data.tokenizer", run.model.vocab_size)
