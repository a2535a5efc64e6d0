"""The process-global changes a depthmix process needs, each one a patch that
:func:`depthmix.runtime.install` applies and :func:`depthmix.runtime.uninstall` undoes.

* :class:`HeldLibraryWarnings`: the libraries' start-up warnings are held back and reported
  as one line (:class:`depthmix.runtime.log.LibraryWarnings`).
* :class:`~depthmix.runtime.cpu.CpuShim`: Megatron on CPU + gloo (only when CUDA is absent).
* :class:`QuietTpGroup`: Megatron's default-TP-group lookup without its deprecation warning.
* :class:`RouterWithoutTE`: Megatron's MoE router gating runs without Transformer Engine.
* :class:`ForkedHelpers`: helper processes die with the trainer; checkpoint writers need no
  ``multiprocessing`` Manager process.
* :class:`LocksReleasedAtExit`: the save directory's lock is released at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing.util
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
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


class RouterWithoutTE:
    """Megatron-Core 0.16.1's router gating (``moe_utils.RouterGatingLinearFunction``) reads
    ``te_general_gemm``, a name ``moe_utils`` binds only when Transformer Engine imports:
    without it every MoE forward is a ``NameError``. Bound to None it takes the function's
    own torch path (``torch.mm`` in the router dtype)."""

    def __init__(self):
        self._bound = False

    def apply(self) -> None:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
            self._bound = True

    def undo(self) -> None:
        from megatron.core.transformer.moe import moe_utils

        if self._bound:
            del moe_utils.te_general_gemm
            self._bound = False


# os.register_at_fork cannot be undone: the hooks are registered once and act while active
_fork = {"registered": False, "active": False, "parent": None}


def _before_fork() -> None:
    # the kernel signals when the forking *thread* ends: only the main thread's forks
    # (Megatron's checkpoint writers, data workers) are tied to the process's lifetime
    main = threading.current_thread() is threading.main_thread()
    _fork["parent"] = os.getpid() if _fork["active"] and main else None


def helpers_die_with_process() -> bool:
    """Processes forked from the main thread now die with this one (:class:`ForkedHelpers`
    is installed, on Linux): a background checkpoint writer cannot outlive the trainer."""
    return _fork["active"] and sys.platform.startswith("linux")


class ResultsQueue:
    """What Megatron's checkpoint writers hand their results back through, as files: it
    works from a forked background writer (``train.async_save``) as well as in-process, and
    needs no ``multiprocessing`` Manager process (a pipe could fill before it is read).

    The directory exists only once a writer has put something, and goes with
    :meth:`close` or the process's exit (a ``multiprocessing`` finalizer: it runs in a rank
    started by ``multiprocessing`` too, and only in the process that made the queue), so
    runs that never save, or end without uninstalling, leave nothing in the temp dir."""

    def __init__(self):
        # uuid4 reads os.urandom: the seeded generators are left alone
        self.directory = os.path.join(tempfile.gettempdir(),
                                      f"depthmix-save-results-{uuid.uuid4().hex[:12]}")
        self._finalizer = multiprocessing.util.Finalize(
            self, shutil.rmtree, args=(self.directory,), kwargs={"ignore_errors": True},
            exitpriority=0)

    def put(self, item) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        path = os.path.join(self.directory, f"{time.time_ns():020d}_{os.getpid()}")
        with open(f"{path}.tmp", "wb") as f:
            pickle.dump(item, f)
        os.replace(f"{path}.tmp", path)

    def get_nowait(self):
        try:
            names = sorted(n for n in os.listdir(self.directory) if not n.endswith(".tmp"))
        except FileNotFoundError:
            names = []
        if not names:
            raise queue.Empty
        path = os.path.join(self.directory, names[0])
        with open(path, "rb") as f:
            item = pickle.load(f)
        os.unlink(path)
        return item

    def close(self) -> None:
        self._finalizer()


class ForkedHelpers:
    """No helper process outlives the trainer.

    Megatron's save writes through ``fork``-ed writer processes and, on first use, starts a
    ``multiprocessing`` Manager (a spawned ~400 MB process) only to carry their results
    back: it gets a :class:`ResultsQueue` (files) instead. And every process forked from the main thread asks the kernel for SIGKILL
    when its parent dies (Linux ``PR_SET_PDEATHSIG``), so ``kill -9`` of the trainer leaves
    nothing behind."""

    def __init__(self):
        self._queue = None

    def apply(self) -> None:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if getattr(filesystem_async, "_results_queue", "absent") is None:
            self._queue = filesystem_async._results_queue = ResultsQueue()
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
        if self._queue is not None:
            self._queue.close()
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
    return [*patches, CpuShim(), QuietTpGroup(), RouterWithoutTE(), ForkedHelpers(),
            LocksReleasedAtExit()]
