"""Fused Triton kernels with plain-PyTorch references, one folder per op: ``kernels/<op>/``.

An op folder holds ``reference.py`` (plain PyTorch: the source of truth and the CPU path),
``triton.py`` (the kernels and their host launchers), ``function.py`` (autograd and the
``depthmix::`` custom ops) and ``__init__.py`` (``IMPLS``: where each implementation lives,
for ``dispatch.select``; the public functions). The benchmarks of each op live in
:mod:`depthmix.bench` (``depthmix/bench/<op>.py``). Every list of ops comes from
:func:`ops`.
"""

import pkgutil
from typing import List


def ops() -> List[str]:
    """Every kernel op: the packages beside this file (importing none of them)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)
