"""Save every ``train.save_interval`` steps, at the end and when stopped."""

from __future__ import annotations

import logging
from typing import Optional

from depthmix.checkpoint.guard import SaveGuard
from depthmix.pretrain.callbacks.base import Callback

log = logging.getLogger("depthmix")


class CheckpointCallback(Callback):
    """Save every ``train.save_interval`` steps, at the end and when stopped, into the run's
    save directory (``trainer.state.save_dir``; which checkpoint a run resumes from is the
    trainer's: :func:`depthmix.checkpoint.distributed.resume_point`).

    Put it **last** in the callback list (before :class:`PreemptionCallback`): its
    ``post_step`` then saves the state after the other callbacks acted on the step, so a
    resumed run replays exactly what follows.
    """

    def __init__(self):
        self.last_saved_step: Optional[int] = None
        self.guard: Optional[SaveGuard] = None

    def setup(self, trainer) -> None:
        # lock, writable, room for a checkpoint: refused now rather than at the first save
        self.guard = SaveGuard.start(trainer.state.save_dir, run=trainer.run, model=trainer.model,
                                     topo=trainer.topo, step=trainer.step)
        if trainer.state.resumed_from and not trainer.state.weights_only:
            self.last_saved_step = trainer.step

    def post_restore(self, trainer) -> None:
        self.last_saved_step = trainer.step  # a rollback loaded the checkpoint of this step

    def save(self, trainer) -> None:
        if self.last_saved_step == trainer.step:
            return
        trainer.save_checkpoint(keep_last=trainer.run.train.keep_last,  # logs it
                                estimate=self.guard.estimate if self.guard else None)
        self.last_saved_step = trainer.step

    def post_step(self, trainer, result) -> None:
        interval = trainer.run.train.save_interval
        if interval and trainer.step % interval == 0:
            self.save(trainer)

    def post_train(self, trainer) -> None:
        """At the end of training, and when stopped early (preemption, exit_after_steps)."""
        if trainer.step > 0:
            self.save(trainer)

    def close(self, trainer) -> None:
        if self.guard is not None:
            self.guard.close()  # the save_dir lock
