"""Which implementation of the depth-mixing ops runs: resolved once, at start-up.

``mixer.impl``: ``torch`` (plain PyTorch, runs anywhere), ``triton`` (fused kernels; a GPU,
or the Triton interpreter on CPU with ``TRITON_INTERPRET=1`` for tests), ``auto`` (Triton
when CUDA and Triton are usable, else torch). :func:`resolve_impl` turns the request into
``torch`` or ``triton`` when the config is loaded (a Triton request that cannot run is
refused there, with the reason); :func:`select` is the only way a module picks a kernel,
and it takes a resolved value only, so nothing switches implementation mid-run.

Every op is a package ``depthmix/kernels/<op>/`` whose ``__init__`` holds
``IMPLS = {"torch": ".reference:<op>_reference", "triton": ".function:<op>_triton"}``:
where each implementation lives, imported on first use (``impl=torch`` never imports
Triton).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from typing import Iterable, Tuple

import torch

from depthmix.config.schema import ConfigError
from depthmix.config.validate import check_choice
from depthmix.kernels._common import interpreting
from depthmix.kernels.modes import IMPLS

log = logging.getLogger(__name__)

RESOLVED = ("torch", "triton")


def triton_status() -> Tuple[bool, str]:
    """(usable, why not) for the Triton kernels on this machine."""
    if importlib.util.find_spec("triton") is None:
        return False, "the triton package is not installed"
    if torch.cuda.is_available():
        return True, "CUDA"
    if interpreting():
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


def _load(package: str, where: str):
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module, package), name)


@functools.lru_cache(maxsize=None)
def select(op: str, impl: str):
    """The implementation of kernel ``op`` (a package under ``depthmix.kernels``) for a
    resolved ``impl`` (``torch`` or ``triton``). ``auto`` is refused: it is resolved once,
    when the config is loaded (:func:`resolve_impl`)."""
    if impl not in RESOLVED:
        raise ValueError(f"kernel {op!r}: impl={impl!r} is not resolved ({' or '.join(RESOLVED)}); "
                         "mixer.impl is resolved once at start-up by dispatch.resolve_impl")
    package = f"{__package__}.{op}"
    try:
        fn = _load(package, importlib.import_module(package).IMPLS[impl])
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise RuntimeError(f"kernel {op!r}: mixer.impl=triton but the triton package is not "
                           "importable") from e
    log.info("kernel %s: %s implementation", op, impl)
    return fn


def lazy_attribute(package: str, name: str, places: Iterable[str]):
    """A kernel package's module ``__getattr__``: the function ``name`` from the first of
    ``places`` (``".module:function"``) that defines it, imported on first access."""
    for where in places:
        if where.endswith(f":{name}"):
            return _load(package, where)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
