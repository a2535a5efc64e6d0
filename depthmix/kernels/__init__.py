"""Fused Triton kernels with plain-PyTorch references, one folder per op: ``kernels/<op>/``.

An op folder holds ``reference.py`` (plain PyTorch: the source of truth and the CPU path),
``triton.py`` (the kernels and their host launchers), ``function.py`` (autograd and the
``depthmix::`` custom ops), ``bench.py`` (:data:`BENCH_HOOKS`: benchmark cases, and the
roofline work and GPU launches of their full shapes) and ``__init__.py`` (``IMPLS``: where
each implementation lives, for ``dispatch.select``; the public functions). Every list of
ops (``tools/bench_kernels.py``, the GPU-compile report, the roofline table, the tests)
comes from :func:`ops`.
"""

import importlib
import pkgutil
from typing import List

BENCH_HOOKS = ("cases", "roofline_work", "gpu_launches")
"""What an op's ``bench.py`` defines: ``cases(smoke)`` (:class:`bench_case.Case` list),
``roofline_work()`` (:class:`roofline.Work` list), ``gpu_launches()``
(:class:`gpu_report.Launch` list)."""


def ops() -> List[str]:
    """Every kernel op: the packages beside this file (importing none of them)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def bench(op: str):
    """The op's ``bench`` module; an error names any of :data:`BENCH_HOOKS` it lacks."""
    module = importlib.import_module(f"{__name__}.{op}.bench")
    missing = [hook for hook in BENCH_HOOKS if not callable(getattr(module, hook, None))]
    if missing:
        raise AttributeError(f"kernel op {op!r} ({module.__file__}) has no {', '.join(missing)}")
    return module
