"""Which implementation of the depth-mixing ops runs: resolved once, at start-up.

``mixer.impl``: ``torch`` (plain PyTorch, runs anywhere), ``triton`` (fused kernels; a GPU,
or the Triton interpreter on CPU with ``TRITON_INTERPRET=1`` for tests), ``auto`` (Triton
when CUDA and Triton are usable, else torch). A Triton request that cannot run is refused
with the reason before anything is built; nothing switches implementation mid-run.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Tuple

import torch

from depthmix.config.mixers.base import IMPLS
from depthmix.config.schema import ConfigError
from depthmix.config.validate import check_choice


def triton_status() -> Tuple[bool, str]:
    """(usable, why not) for the Triton kernels on this machine."""
    if importlib.util.find_spec("triton") is None:
        return False, "the triton package is not installed"
    if torch.cuda.is_available():
        return True, "CUDA"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "the Triton interpreter (TRITON_INTERPRET=1, CPU, slow)"
    return False, ("CUDA is not available; set TRITON_INTERPRET=1 to run the kernels in "
                   "Triton's CPU interpreter (tests only)")


def resolve_impl(requested: str) -> Tuple[str, str]:
    """Returns (impl, reason)."""
    check_choice("mixer.impl", requested, IMPLS)
    usable, why = triton_status()
    if requested == "torch":
        return "torch", "requested"
    if requested == "triton":
        if not usable:
            raise ConfigError(f"mixer.impl=triton cannot run here: {why}")
        return "triton", why
    if requested == "auto":
        if usable and torch.cuda.is_available():
            return "triton", "auto: CUDA and Triton available"
        return "torch", f"auto: {why if not usable else 'no CUDA device'}"
    raise AssertionError(requested)
