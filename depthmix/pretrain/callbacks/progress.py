"""A progress bar between log lines (long steps, long log intervals), terminals only."""

from __future__ import annotations

import sys

from depthmix.runtime import log as run_log
from depthmix.pretrain.callbacks.base import Callback


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
