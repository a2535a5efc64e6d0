"""Save every ``train.save_interval`` steps, at the end and when stopped."""

from __future__ import annotations

import logging
from typing import Optional

from depthmix.checkpoint.background import BackgroundSaves
from depthmix.checkpoint.guard import SaveGuard
from depthmix.pretrain.callbacks.base import Callback
from depthmix.pretrain.health import Action
from depthmix.runtime.patches import helpers_die_with_process

log = logging.getLogger("depthmix")


class CheckpointCallback(Callback):
    """Save every ``train.save_interval`` steps, at the end and when stopped, into the run's
    save directory (``trainer.state.save_dir``; which checkpoint a run resumes from is the
    trainer's: :func:`depthmix.checkpoint.resume.resume_point`).

    With ``train.async_save`` the interval saves are written in the background
    (:mod:`depthmix.checkpoint.background`): each step then polls the pending write and
    publishes it once every rank's write has finished; the step right after a save still
    settles its health mark, as with a synchronous save. The final save (end of training,
    preemption) waits for a pending write, then saves synchronously.

    Put it **last** in the callback list (before :class:`PreemptionCallback`): its
    ``post_step`` then saves the state after the other callbacks acted on the step, so a
    resumed run replays exactly what follows.
    """

    def __init__(self):
        self.last_saved_step: Optional[int] = None
        self.guard: Optional[SaveGuard] = None
        self.background: Optional[BackgroundSaves] = None
        self._settled: Optional[bool] = None  # the step after a pending save: finite?

    def setup(self, trainer) -> None:
        # lock, writable, room for a checkpoint: refused now rather than at the first save
        self.guard = SaveGuard.start(trainer.state.save_dir, run=trainer.run, model=trainer.model,
                                     topo=trainer.topo, step=trainer.step)
        if trainer.state.resumed_from and not trainer.state.weights_only:
            self.last_saved_step = trainer.step
        if trainer.run.train.async_save:
            if helpers_die_with_process():
                self.background = BackgroundSaves()
            else:
                log.info("train.async_save: a background writer could not be tied to this "
                         "process's lifetime here; saving synchronously")

    def post_restore(self, trainer) -> None:
        self.last_saved_step = trainer.step  # a rollback loaded the checkpoint of this step

    def save(self, trainer, final: bool = False) -> None:
        if self.last_saved_step == trainer.step:
            return
        background = None if final else self.background
        if background is not None and background.pending is not None:
            self._published(trainer, background.wait(
                f"the checkpoint of step {trainer.step} is due; one write at a time"))
        trainer.save_checkpoint(keep_last=trainer.run.train.keep_last,  # logs it
                                estimate=self.guard.estimate if self.guard else None,
                                background=background)
        self._settled = None
        self.last_saved_step = trainer.step

    def post_step(self, trainer, result) -> None:
        saves = self.background
        if saves is not None and saves.pending is not None:
            if self._settled is None and (result.nonfinite or
                                          trainer.verdict.action is Action.APPLY):
                self._settled = not result.nonfinite
            if trainer.verdict.action in (Action.ROLLBACK, Action.STOP):
                path = saves.wait(f"step {trainer.step}: {trainer.verdict.reason}")
            else:
                path = saves.poll()
            self._published(trainer, path)
        interval = trainer.run.train.save_interval
        if interval and trainer.step % interval == 0:
            # a step the run stops or rolls back after: its checkpoint is written now (the
            # stop raises before any later step could publish a background write)
            self.save(trainer, final=trainer.verdict.action in (Action.ROLLBACK, Action.STOP))

    def _published(self, trainer, path: Optional[str]) -> None:
        """A background write was published: settle its health mark now if the step after
        it already ran, else let the next step do it (as after a synchronous save)."""
        if path is None:
            return
        healthy = self.background.healthy
        trainer.state.unconfirmed = path if healthy else None
        if healthy and self._settled is not None:
            trainer._settle_checkpoint(finite=self._settled)
        self._settled = None

    def post_train(self, trainer) -> None:
        """At the end of training, and when stopped early (preemption, exit_after_steps):
        a pending background write is finished first."""
        if self.background is not None and self.background.pending is not None:
            self._published(trainer, self.background.wait("training ends"))
        if trainer.step > 0:
            self.save(trainer, final=True)

    def on_error(self, trainer, exc) -> None:
        if self.background is not None:
            self.background.abort()  # the other ranks may be gone: no collective wait

    def close(self, trainer) -> None:
        if self.background is not None:
            self.background.abort()
        if self.guard is not None:
            self.guard.close()  # the save_dir lock
