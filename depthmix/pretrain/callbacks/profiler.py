"""``train.profile_steps=[first,last]``: a torch profiler trace of those training steps;
:func:`profile_calls` for the benchmark tools.

Every rank writes ``<output_dir>/profile/trace_steps<first>-<last>_rank<r>.json`` (Chrome
trace format: open in https://ui.perfetto.dev or ``chrome://tracing``); on CUDA also
``memory_steps<first>-<last>_rank<r>.pickle``, a CUDA memory snapshot (allocations with
their stacks during those steps; drag it into https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from depthmix.pretrain.callbacks.base import Callback
from depthmix.runtime.log import say

log = logging.getLogger("depthmix")

MEMORY_HISTORY_ENTRIES = 100_000


def _activities() -> list:
    """The host, and the GPU where there is one."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


class ProfilerCallback(Callback):
    def __init__(self):
        self.profiler: Optional[torch.profiler.profile] = None
        self._step_range = None
        self.memory = False

    def _range(self, trainer):
        first, last = trainer.run.train.profile_steps
        return int(first), int(last)

    def _stem(self, trainer, kind: str, ext: str) -> str:
        first, last = self._range(trainer)
        directory = os.path.join(trainer.run.output_dir, "profile")
        os.makedirs(directory, exist_ok=True)
        return os.path.join(directory, f"{kind}_steps{first}-{last}_rank{trainer.topo.rank}.{ext}")

    def _maybe_start(self, trainer) -> None:
        """Before the step that is the first one to profile (or, resuming inside the
        range, before the next step)."""
        first, last = self._range(trainer)
        if self.profiler is not None or not first <= trainer.step + 1 <= last:
            return
        if torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self.memory = True
        self.profiler = torch.profiler.profile(activities=_activities(), record_shapes=True,
                                               profile_memory=True, with_stack=False)
        self.profiler.__enter__()
        self._mark(trainer.step + 1)

    def _mark(self, step: Optional[int]) -> None:
        """A ``depthmix step <n>`` range around each profiled step in the trace."""
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if step is not None:
            self._step_range = torch.profiler.record_function(f"depthmix step {step}")
            self._step_range.__enter__()

    def _stop(self, trainer) -> None:
        if self.profiler is None:
            return
        self._mark(None)
        self.profiler.__exit__(None, None, None)
        trace = self._stem(trainer, "trace", "json")
        self.profiler.export_chrome_trace(trace)
        self.profiler = None
        written = [trace]
        if self.memory:
            snapshot = self._stem(trainer, "memory", "pickle")
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False
            written.append(snapshot)
        if trainer.topo.is_logging_rank:
            say(f"profile of steps {'-'.join(map(str, self._range(trainer)))}: "
                f"{', '.join(written)}")

    def pre_train(self, trainer) -> None:
        self._maybe_start(trainer)

    def post_step(self, trainer, result) -> None:
        if self.profiler is not None:
            if trainer.step >= self._range(trainer)[1]:
                self._stop(trainer)
            else:
                self._mark(trainer.step + 1)
        self._maybe_start(trainer)

    def post_train(self, trainer) -> None:
        self._stop(trainer)  # stopped (preemption, exit_after_steps) inside the range

    def on_error(self, trainer, exc: BaseException) -> None:
        try:
            self._stop(trainer)
        except Exception:
            log.warning("could not write the profiler trace after the error", exc_info=True)


@dataclass
class CallProfile:
    host_ms: float
    """Host time per call under the profiler (the profiler's own bookkeeping included)."""
    kernel_ms: float
    """GPU kernel time per call (0 without CUDA)."""
    table: object
    """``torch.profiler``'s operator averages (``.table(...)`` prints them)."""


def profile_calls(call: Callable[[], object], iters: int,
                  trace: Optional[str] = None) -> CallProfile:
    """``call()`` ``iters`` times under ``torch.profiler``, after one profiled warm-up call
    that takes the profiler's own start-up out of the numbers; ``trace``: also a Chrome
    trace there. Python stacks on a GPU only: in Triton's CPU interpreter every kernel
    program is Python, and its stacks outgrow memory."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps = torch.profiler.schedule(wait=0, warmup=1, active=iters, repeat=1)
    with torch.profiler.profile(activities=_activities(), with_stack=cuda,
                                schedule=steps) as prof:
        for _ in range(iters + 1):
            call()
            sync()
            prof.step()
    table = prof.key_averages()
    host = sum(e.self_cpu_time_total for e in table) / iters / 1e3
    kernels = sum(e.self_device_time_total for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA) / iters / 1e3
    if trace:
        os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
        prof.export_chrome_trace(trace)
    return CallProfile(host, kernels, table)
