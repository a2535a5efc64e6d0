"""The process a command runs in: its launcher environment (:mod:`.env`), console and log
stream (:mod:`.log`), exit statuses (:mod:`.exit_codes`) and the process-global patches
(:mod:`.patches`: the CPU shim, Megatron quirks, forked helpers, held library warnings).

Importing depthmix changes nothing global. The patches are applied only by :func:`install`,
called by the entry points (:mod:`depthmix.cli`, ``tools/``) and the test harness, and
taken back by :func:`uninstall` (or use :func:`installed` as a context manager). Nested
installs count: only the outermost applies and undoes them. The library functions a user
calls from Python (``load_model``, ``DepthmixLM``, ``evaluate_tasks``, ...) are marked
:func:`entry_point`: the first one called installs the runtime for the rest of the process
(:func:`ensure_installed`), so they work in a fresh interpreter on CPU as on GPU.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, List, TypeVar

F = TypeVar("F", bound=Callable)

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


def ensure_installed() -> None:
    """Install the runtime unless it is installed (by a command, the test harness, the
    caller or an earlier library call); it then stays for the rest of the process
    (:func:`uninstall` takes it back). Python's warning handling stays the caller's."""
    if not _depth:
        install(hold_warnings=False)


def entry_point(function: F) -> F:
    """Mark a library function a user calls from Python: :func:`ensure_installed` runs
    before it (nothing happens when the function is only imported or decorated)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        ensure_installed()
        return function(*args, **kwargs)

    return wrapper
