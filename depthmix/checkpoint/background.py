"""Checkpoints written in the background (``train.async_save``): the training loop hands the
state to a writer process and goes on.

Megatron-Core's asynchronous ``dist_checkpointing`` save plans the write on every rank, then
a forked process (a copy-on-write snapshot of this step's state) writes the shards while
training continues. The checkpoint is published (checksums, ``depthmix.json``, tracker,
retention: :func:`~depthmix.checkpoint.distributed.publish`) only once every rank's writer
has finished; until then it is a ``.tmp_iter_*`` directory that no resume looks at.

* At most one write is in flight: a save that comes due while one is pending first waits
  for it (logged).
* :meth:`BackgroundSaves.poll` after every step is collective (one all-reduce while a write
  is pending): every rank publishes at the same step.
* A failed write (disk full, ...) raises :class:`~depthmix.checkpoint.guard.SaveError` on
  every rank at the poll that finds it, after its temporary directory is removed: the run
  stops like a failed synchronous save, the previous checkpoint intact.
* The writer ignores SIGINT/SIGTERM/SIGUSR1 (the trainer decides: it waits for the write,
  then saves the final state) and dies with the trainer (``runtime.patches.ForkedHelpers``):
  after ``kill -9`` nothing is left but the ``.tmp_iter_*`` directory, removed at the next
  start.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from typing import Optional

from depthmix.checkpoint import distributed, guard, store

log = logging.getLogger("depthmix")

WRITER_DELAY_ENV = "DEPTHMIX_CKPT_WRITER_DELAY"
"""Seconds each background writer waits before writing: fault-injection tests
(``tools/chaos.py``) use it to interrupt a run while a write is in flight."""


def _writer(write, *args, **kwargs):
    """The forked writer process: the trainer handles the signals, the writer just writes."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    delay = float(os.environ.get(WRITER_DELAY_ENV) or 0)
    if delay > 0:
        time.sleep(delay)
    return write(*args, **kwargs)


class BackgroundSaves:
    """One run's background checkpoint writes (at most one in flight)."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)
        self.pending: Optional[distributed.Written] = None
        self.scheduled_at = 0.0
        self.healthy = True
        """The health mark of the last published checkpoint: healthy?"""

    def start(self, root: str, **save) -> float:
        """Collective: wait for a pending write, then plan the checkpoint of ``save['step']``
        and fork its writer. Returns the seconds the caller was blocked (the wait excluded)."""
        if self.pending is not None:
            self.wait(f"the checkpoint of step {save['step']} is due")
        began = time.perf_counter()
        written = distributed.write(root, background=True, **save)
        request = written.request
        if request is not None and request.async_fn is not None:
            request = request._replace(async_fn=functools.partial(_writer, request.async_fn))
        with guard.failing(root, written.step, written.estimate):
            self.queue.schedule_async_request(request)
        self.pending, self.scheduled_at = written, time.perf_counter()
        blocked = self.scheduled_at - began
        log.info("checkpoint of step %d: writing in the background (training blocked %.2f s)",
                 written.step, blocked)
        return blocked

    def pending_path(self) -> Optional[str]:
        """Where the pending checkpoint appears once published."""
        return store.step_dir(self.pending.root, self.pending.step) if self.pending else None

    def poll(self) -> Optional[str]:
        """Collective, non-blocking: publish the pending checkpoint if every rank's write has
        finished; returns its path then, else None."""
        return self._finish(blocking=False) if self.pending is not None else None

    def wait(self, why: str = "") -> Optional[str]:
        """Collective: wait for the pending write (logged with ``why``) and publish it."""
        if self.pending is None:
            return None
        began, step = time.perf_counter(), self.pending.step
        path = self._finish(blocking=False)
        if path is None:
            log.info("waiting for the background write of the checkpoint of step %d%s",
                     step, f" ({why})" if why else "")
            path = self._finish(blocking=True)
            log.info("waited %.2f s for the checkpoint of step %d",
                     time.perf_counter() - began, step)
        return path

    def _finish(self, blocking: bool) -> Optional[str]:
        written = self.pending
        with guard.failing(written.root, written.step, written.estimate):
            try:
                done = self.queue.maybe_finalize_async_calls(blocking=blocking)
            except BaseException:
                self.pending = None
                raise
            if not done:
                return None
            self.pending = None
            path = distributed.publish(written)
        self.healthy = written.meta["health"].get("healthy", True)
        log.info("saved checkpoint %s in the background (%.2f s after it was handed over)",
                 path, time.perf_counter() - self.scheduled_at)
        return path

    def abort(self) -> None:
        """This rank only (an error, the others may be gone): kill the writer; the
        temporary directory stays until the next start removes it."""
        if self.pending is not None:
            self.pending = None
            self.queue.close(abort=True)
            for call in list(self.queue.async_calls):
                call.async_caller.close(abort=True)
            self.queue.async_calls.clear()
