"""``preflight(run, world_size)``: everything checked before a process group or model exists.

The trainer and ``train.dry_run`` call this one function. It runs the option checks of
:func:`depthmix.config.validate.validate` (with the layout checks for ``world_size``), then
the checks that touch files:

* data: the embedded corpus' vocabulary fits ``model.vocab_size``; every ``data.prefixes`` entry has its ``.bin``/``.idx`` (and passes
  ``depthmix.data.integrity.check_prefix`` where that module exists); ``data.split`` gives
  every split with a positive weight at least one document (Megatron would loop for ever);
* tokenizer: ``data.tokenizer`` loads and its vocabulary fits ``model.vocab_size``;
* checkpoints (:mod:`depthmix.checkpoint.store`): the save directory exists as a writable
  directory or can be created; the checkpoint a run would resume fits its configuration;
* compilation (``train.compile=true``): a recent enough torch, a C++ compiler for inductor
  on CPU, and no option the compiled layers cannot run.

Each failure is a :class:`ConfigError` naming the option. Nothing here imports torch or
Megatron, and nothing is written.
"""

from __future__ import annotations

import os
import shutil
import struct
from typing import List, Optional

from depthmix.checkpoint.store import check_save_dir, preflight_checkpoint
from depthmix.config.schema import ConfigError, RunConfig
from depthmix.config.validate import parse_blend, split_weights, validate

_IDX_MAGIC = b"MMIDIDX\x00\x00"
SPLITS = ("train", "valid", "test")


def preflight(run: RunConfig, world_size: int, data: bool = True) -> None:
    """Raise :class:`ConfigError` naming the option if this run cannot start. ``data``:
    also check the data options (false when the caller brings its own data)."""
    validate(run, world_size)
    if data:
        check_data(run)
    check_save_dir(run)
    check_compile(run)
    preflight_checkpoint(run)  # a checkpoint of another configuration is refused here


# ------------------------------------------------------------------------ compile
COMPILE_MIN_TORCH = (2, 6)
"""``Module.compile`` with built-in module inlining and ``fail_on_recompile_limit_hit``."""


def check_compile(run: RunConfig) -> None:
    """``train.compile=true`` (``auto`` decides for itself: :func:`depthmix.pretrain.compile.
    enabled`) is refused here, naming the option, rather than falling back mid-run."""
    if run.train.compile != "true":
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torch")
    except PackageNotFoundError:
        return
    numbers = tuple(int(p) for p in found.split("+")[0].split(".")[:2] if p.isdigit())
    if numbers < COMPILE_MIN_TORCH:
        raise ConfigError(f"train.compile=true needs torch >= "
                          f"{'.'.join(map(str, COMPILE_MIN_TORCH))} (found {found}); "
                          "set train.compile=false")
    if not _has_cuda_device() and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        raise ConfigError("train.compile=true on CPU needs a C++ compiler for inductor (none "
                          "of c++, g++, clang++ on PATH); set train.compile=false")


def _has_cuda_device() -> bool:
    """Without importing torch: a visible NVIDIA device node."""
    return os.path.exists("/dev/nvidia0") and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


# ------------------------------------------------------------------------ data
def sequence_count(prefix: str) -> int:
    """Number of sequences (documents) in a Megatron ``.idx``, from its header."""
    path = f"{prefix}.idx"
    with open(path, "rb") as f:
        header = f.read(34)
    if len(header) < 34 or header[:9] != _IDX_MAGIC:
        raise ConfigError(f"data.prefixes: {path} is not a Megatron index file "
                          "(make it with depthmix-preprocess)")
    return struct.unpack("<Q", header[18:26])[0]


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
    from depthmix.data.integrity import check_prefix

    paths, weights = parse_blend(d.prefixes)
    for i, path in enumerate(paths):
        prefix = os.path.abspath(os.path.expanduser(path))
        if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
            raise ConfigError(f"data.prefixes: {prefix}.bin/.idx not found "
                              "(make them with depthmix-preprocess)")
        # header, sizes and index consistency (the pass over every document: build_data)
        check_prefix(prefix, f"data.prefixes[{2 * i + 1 if weights else i}]", deep=False)
        _check_split(d.split, prefix, sequence_count(prefix))
    from depthmix.data.tokenizer import load_tokenizer

    load_tokenizer(d.tokenizer, "data.tokenizer", run.model.vocab_size)
