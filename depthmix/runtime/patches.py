"""The process-global changes a depthmix process needs, each one a patch that
:func:`depthmix.runtime.install` applies and :func:`depthmix.runtime.uninstall` undoes.

* :class:`HeldLibraryWarnings`: the libraries' start-up warnings are held back and reported
  as one line (:class:`depthmix.runtime.log.LibraryWarnings`).
* :class:`~depthmix.runtime.cpu.CpuShim`: Megatron on CPU + gloo (only when CUDA is absent).
* :class:`QuietTpGroup`: Megatron's default-TP-group lookup without its deprecation warning.
* :class:`ForkedHelpers`: helper processes die with the trainer; synchronous saves need no
  ``multiprocessing`` Manager process.
* :class:`LocksReleasedAtExit`: the save directory's lock is released at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import signal
import sys
import threading
import warnings
from typing import List

from depthmix.runtime import exit_codes
from depthmix.runtime.cpu import CpuShim

PR_SET_PDEATHSIG = 1


class HeldLibraryWarnings:
    """Starts :data:`depthmix.runtime.log.startup_warnings` (the console callback reports
    it once the model is built); :meth:`undo` restores ``warnings.showwarning`` and
    ``warnings.filters`` as they were, including the filters the report added."""

    def __init__(self):
        self._scope = None

    def apply(self) -> None:
        from depthmix.runtime.log import startup_warnings

        self._scope = warnings.catch_warnings()
        self._scope.__enter__()
        startup_warnings.start()

    def undo(self) -> None:
        from depthmix.runtime.log import startup_warnings

        startup_warnings.stop(keep_quiet=False)
        self._scope.__exit__(None, None, None)
        self._scope = None


class QuietTpGroup:
    """Megatron's ``RowParallelLinear`` asks for "the default TP group" with a deprecation
    warning on rank 0 every call, and ``warnings.warn`` breaks a compiled graph there
    (``train.compile``). The replacement returns the same group without the warning."""

    def __init__(self):
        self._original = None

    def apply(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import layers

        original = self._original = layers.get_tensor_model_parallel_group_if_none

        def tp_group_or_default(tp_group, is_expert=False, check_initialized=True):
            if tp_group is not None or not parallel_state.is_initialized():
                return original(tp_group, is_expert, check_initialized)
            if is_expert:
                return parallel_state.get_expert_tensor_parallel_group(
                    check_initialized=check_initialized)
            return parallel_state.get_tensor_model_parallel_group(
                check_initialized=check_initialized)

        layers.get_tensor_model_parallel_group_if_none = tp_group_or_default

    def undo(self) -> None:
        from megatron.core.tensor_parallel import layers

        layers.get_tensor_model_parallel_group_if_none = self._original


# os.register_at_fork cannot be undone: the hooks are registered once and act while active
_fork = {"registered": False, "active": False, "parent": None}


def _before_fork() -> None:
    # the kernel signals when the forking *thread* ends: only the main thread's forks
    # (Megatron's checkpoint writers, data workers) are tied to the process's lifetime
    main = threading.current_thread() is threading.main_thread()
    _fork["parent"] = os.getpid() if _fork["active"] and main else None


class ForkedHelpers:
    """No helper process outlives the trainer.

    Megatron's synchronous save writes through ``fork``-ed writer processes and, on first
    use, starts a ``multiprocessing`` Manager (a spawned ~400 MB process) only to carry their
    results back to this same process: it gets a plain in-process queue instead (its
    ``FileSystemWriterAsync`` queue is made for asynchronous saves, where another process
    finalizes). And every process forked from the main thread asks the kernel for SIGKILL
    when its parent dies (Linux ``PR_SET_PDEATHSIG``), so ``kill -9`` of the trainer leaves
    nothing behind."""

    def __init__(self):
        self._queue = None

    def apply(self) -> None:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if getattr(filesystem_async, "_results_queue", "absent") is None:
            self._queue = filesystem_async._results_queue = queue.Queue()
        if not sys.platform.startswith("linux"):
            return
        if not _fork["registered"]:
            libc = ctypes.CDLL(None, use_errno=True)  # loaded now: a forked child only calls it

            def in_child() -> None:
                if _fork["parent"] is None:
                    return
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != _fork["parent"]:  # the parent died before prctl
                    os._exit(exit_codes.CRASH)

            os.register_at_fork(before=_before_fork, after_in_child=in_child)
            _fork["registered"] = True
        _fork["active"] = True

    def undo(self) -> None:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        _fork["active"] = False
        if self._queue is not None and filesystem_async._results_queue is self._queue:
            filesystem_async._results_queue = None
        self._queue = None


class LocksReleasedAtExit:
    """The save-directory locks this process holds are released at exit (an abort too);
    :meth:`undo` releases them now."""

    def apply(self) -> None:
        from depthmix.checkpoint.guard import release_all

        atexit.register(release_all)

    def undo(self) -> None:
        from depthmix.checkpoint.guard import release_all

        release_all()
        atexit.unregister(release_all)


def every_patch(hold_warnings: bool = True) -> List:
    """In the order they are applied (the warnings are held before Megatron is imported)."""
    patches = [HeldLibraryWarnings()] if hold_warnings else []
    return [*patches, CpuShim(), QuietTpGroup(), ForkedHelpers(), LocksReleasedAtExit()]
