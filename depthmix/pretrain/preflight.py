"""``preflight(run, world_size)``: everything checked before a process group or model exists.

The trainer and ``train.dry_run`` call this one function. It runs the option checks of
:func:`depthmix.config.validate.validate` (with the layout checks for ``world_size``), then
the checks that touch files:

* data and tokenizer: :func:`depthmix.data.checks.check_data`;
* checkpoints (:mod:`depthmix.checkpoint.store`, :mod:`~depthmix.checkpoint.resume`): the save directory exists as a writable
  directory or can be created; the checkpoint a run would resume fits its configuration;
* compilation (``train.compile=true``): a recent enough torch, a C++ compiler for inductor
  on CPU, and no option the compiled layers cannot run;
* CUDA graphs (``train.cuda_graphs=true``): a GPU.

Each failure is a :class:`ConfigError` naming the option. Nothing here imports torch or
Megatron, and nothing is written.
"""

from __future__ import annotations

import os
import shutil

from depthmix.checkpoint.resume import preflight_checkpoint
from depthmix.checkpoint.store import check_save_dir
from depthmix.config.schema import ConfigError, RunConfig
from depthmix.config.validate import validate
from depthmix.data.checks import check_data


def preflight(run: RunConfig, world_size: int, data: bool = True) -> None:
    """Raise :class:`ConfigError` naming the option if this run cannot start. ``data``:
    also check the data options (false when the caller brings its own data)."""
    validate(run, world_size)
    if data:
        check_data(run)
    check_save_dir(run)
    check_compile(run)
    check_cuda_graphs(run)
    preflight_checkpoint(run)  # a checkpoint of another configuration is refused here


# ------------------------------------------------------------------------ compile
COMPILE_MIN_TORCH = (2, 6)
"""``Module.compile`` with built-in module inlining and ``fail_on_recompile_limit_hit``."""


def check_compile(run: RunConfig) -> None:
    """``train.compile=true`` (``auto`` decides for itself: :func:`depthmix.pretrain.compile.
    enabled`) is refused here, naming the option, rather than falling back mid-run."""
    if run.train.compile != "true":
        return
    if run.model.experts is not None:
        raise ConfigError("train.compile=true with experts (model.moe): Megatron's MoE layer "
                          "dispatches tokens in data-dependent shapes, which compiled layers "
                          "recompile for past their limit; set train.compile=false (auto is "
                          "off with experts)")
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


def check_cuda_graphs(run: RunConfig) -> None:
    """``train.cuda_graphs=true`` records CUDA graphs of the compiled layers: refused without
    a GPU (where ``train.compile=auto`` is on; ``train.compile=false`` is refused by
    :func:`~depthmix.config.validate.validate_train`), rather than training without them."""
    if run.train.cuda_graphs and run.model.experts is not None:
        raise ConfigError("train.cuda_graphs=true with experts (model.moe): the layers are "
                          "not compiled with experts; set train.cuda_graphs=false")
    if run.train.cuda_graphs and not _has_cuda_device():
        raise ConfigError("train.cuda_graphs=true needs a CUDA GPU (none visible); set "
                          "train.cuda_graphs=false")


def _has_cuda_device() -> bool:
    """Without importing torch: a visible NVIDIA device node."""
    return os.path.exists("/dev/nvidia0") and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
