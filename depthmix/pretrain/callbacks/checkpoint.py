"""Resume at start-up, save every ``train.save_interval`` steps, at the end and when stopped."""

from __future__ import annotations

import logging
import os
from typing import Optional

from depthmix.config.schema import ConfigError
from depthmix.pretrain import checkpoint as ckpt
from depthmix.pretrain.callbacks.base import Callback
from depthmix.pretrain.run_log import say

log = logging.getLogger("depthmix")


def save_dir(run) -> str:
    return run.train.save_dir or os.path.join(run.output_dir, "checkpoints")


class CheckpointCallback(Callback):
    """Owns ``trainer.save_dir`` and ``trainer.resumed_from``.

    Resume rule: the save directory's latest checkpoint if there is one (this run's own
    progress: a requeued or re-run job continues, loading everything), else
    ``train.load_dir`` if given (it must hold a checkpoint; ``train.load_optimizer=false``
    takes only its weights), else a fresh start.

    Put it **last** in the callback list (before :class:`PreemptionCallback`): its
    ``post_step`` then saves the state after the other callbacks acted on the step, so a
    resumed run replays exactly what follows. (Its ``setup`` restores the step, data
    position and RNG before the data is built; other callbacks' ``setup`` must not depend
    on the restored state.)
    """

    def __init__(self):
        self.last_saved_step: Optional[int] = None

    def setup(self, trainer) -> None:
        t = trainer.run.train
        trainer.save_dir = save_dir(trainer.run)
        trainer.resumed_from = None
        path, load_optimizer = ckpt.latest_checkpoint(trainer.save_dir), True
        if path is None and t.load_dir:
            path, load_optimizer = ckpt.latest_checkpoint(t.load_dir), t.load_optimizer
            if path is None:
                raise ConfigError(f"train.load_dir={t.load_dir} holds no checkpoint "
                                  f"(no {ckpt.TRACKER} and no {ckpt.META})")
        if path is None:
            return
        meta = ckpt.load(trainer, path, load_optimizer=load_optimizer)
        trainer.resumed_from = path
        if load_optimizer:
            self.last_saved_step = trainer.step
        if trainer.topo.is_logging_rank:
            say(f"resumed from {path} at step {meta['step']}"
                + ("" if load_optimizer else " (weights only)"))

    def save(self, trainer) -> None:
        if self.last_saved_step == trainer.step:
            return
        ckpt.save(trainer, trainer.save_dir, keep_last=trainer.run.train.keep_last)  # logs it
        self.last_saved_step = trainer.step

    def post_step(self, trainer, result) -> None:
        interval = trainer.run.train.save_interval
        if interval and trainer.step % interval == 0:
            self.save(trainer)

    def post_train(self, trainer) -> None:
        """At the end of training, and when stopped early (preemption, exit_after_steps)."""
        if trainer.step > 0:
            self.save(trainer)
