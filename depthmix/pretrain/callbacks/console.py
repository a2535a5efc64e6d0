"""The console: one log line per interval from the single rank that sees the loss, and a
progress bar between log lines (long steps, long log intervals) on a terminal."""

from __future__ import annotations

import math
import os
import sys

from depthmix.runtime import log as run_log
from depthmix.pretrain.callbacks.base import Callback


class ConsoleLogger(Callback):
    """``step | loss | lr | grad norm | loss scale | tokens/s | TFLOP/s per device | MFU |
    memory | s/step`` (TFLOP/s and MFU only where the device's peak is known), with experts
    ``| aux | z`` (their losses, mean over the MoE layers) after the loss and a second line
    ``experts step | load max/mean at the worst layer | dropped``
    (:class:`~depthmix.pretrain.experts.ExpertLoad`). Throughput
    is the trainer's (averaged over the steps since the last log step). Lines go through
    :func:`run_log.say` (console and ``train.log``), or to ``printer`` when given. Before
    training starts it prints the start-up summary of the libraries' warnings."""

    def __init__(self, printer=None):
        self.printer = printer

    def _emit(self, trainer, text: str) -> None:
        if not trainer.topo.is_logging_rank:
            return
        (self.printer or run_log.say)(text)

    def setup(self, trainer) -> None:
        if trainer.topo.is_logging_rank and self.printer is None:
            run_log.also_to_file(os.path.join(trainer.run.output_dir, "train.log"))

    def pre_train(self, trainer) -> None:
        verbose = trainer.run.train.verbose
        line = run_log.startup_warnings.finish(verbose)
        if line:
            self._emit(trainer, line)

    def post_step(self, trainer, result) -> None:
        from depthmix.runtime.device import memory_stats

        t, perf = trainer.run.train, result.perf
        if perf is None or not trainer.topo.is_logging_rank:  # not a log step
            return
        grad = f"{result.grad_norm:.3f}" if result.grad_norm is not None else "-"
        flops = (f" | {perf.tflops_per_device:.2f} TFLOP/s | MFU {100 * perf.mfu:.1f}%"
                 if perf.mfu is not None else "")
        mem = memory_stats()
        mem_text = (f" | mem {mem['mem/peak_alloc_gib']:.1f} GiB" if "mem/peak_alloc_gib" in mem
                    else f" | rss {mem['mem/rss_gib']:.2f} GiB" if "mem/rss_gib" in mem else "")
        experts = result.experts
        self._emit(
            trainer,
            f"step {trainer.step:>6}/{t.steps} | loss {result.loss:.4f}"
            f"{experts.losses() if experts is not None else ''} | lr {result.lr:.3e} "
            f"| grad {grad} | scale {result.loss_scale:g} | {perf.tokens_per_s:,.0f} tok/s"
            f"{flops}{mem_text} "
            f"| {perf.seconds_per_step:.3f} s/step" + (" | skipped" if result.skipped else "")
            + (f" | nonfinite {result.nonfinite_steps}" if result.nonfinite_steps else ""),
        )
        if experts is not None:
            self._emit(trainer, f"experts step {trainer.step:>6} | {experts.summary()}")

    def post_eval(self, trainer, result) -> None:
        ppl = math.exp(min(result.loss, 50))
        self._emit(trainer, f"eval step {trainer.step:>6} | loss {result.loss:.4f} | ppl {ppl:.2f}")


class ProgressBar(Callback):
    """tqdm over the training steps on the logging rank when stderr is a terminal (never
    in SLURM/batch logs, where the per-interval log line is the record). Shows the last
    loss and seconds per step, so a slow step is visible before the next log line."""

    def __init__(self, force: bool = False):
        self.force = force
        self.bar = None

    def pre_train(self, trainer) -> None:
        if not trainer.topo.is_logging_rank or not (self.force or sys.stderr.isatty()):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=trainer.run.train.steps, initial=trainer.step, unit="step",
                        dynamic_ncols=True, leave=False)
        run_log.set_progress_bar(self.bar)  # console lines are written above it

    def post_step(self, trainer, result) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{result.loss:.4f}",
                                 s_per_step=f"{result.seconds:.2f}",
                                 refresh=False)
            self.bar.update(1)

    def post_train(self, trainer) -> None:
        self.close(trainer)

    def close(self, trainer) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            run_log.set_progress_bar(None)
