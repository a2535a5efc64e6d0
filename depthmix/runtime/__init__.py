"""The process a command runs in: its launcher environment (:mod:`.env`), console and log
stream (:mod:`.log`), exit statuses (:mod:`.exit_codes`) and the process-global patches
(:mod:`.patches`: the CPU shim, Megatron quirks, forked helpers, held library warnings).

Importing depthmix changes nothing global. The patches are applied only by :func:`install`,
called by the entry points (:mod:`depthmix.cli`, ``tools/``) and the test harness, and
taken back by :func:`uninstall` (or use :func:`installed` as a context manager). Nested
installs count: only the outermost applies and undoes them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

_applied: List = []
_depth = 0


def install(hold_warnings: bool = True) -> None:
    """Apply every patch (:func:`depthmix.runtime.patches.every_patch`); ``hold_warnings``:
    hold back the libraries' start-up warnings for the console's one-line report (the test
    harness keeps Python's own warning handling)."""
    global _depth
    _depth += 1
    if _depth > 1:
        return
    from depthmix.runtime.patches import every_patch

    try:
        for patch in every_patch(hold_warnings):
            patch.apply()
            _applied.append(patch)
    except BaseException:
        _depth = 1
        uninstall()
        raise


def uninstall() -> None:
    """Undo what :func:`install` applied, in reverse order (the outermost call only)."""
    global _depth
    if _depth == 0:
        return
    _depth -= 1
    if _depth:
        return
    while _applied:
        _applied.pop().undo()


def is_installed() -> bool:
    return _depth > 0


@contextlib.contextmanager
def installed(hold_warnings: bool = True) -> Iterator[None]:
    install(hold_warnings)
    try:
        yield
    finally:
        uninstall()
