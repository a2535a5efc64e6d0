"""Resume at start-up, save every ``train.save_interval`` steps, at the end and when stopped."""

from __future__ import annotations

import logging
from typing import Optional

from depthmix.config.schema import ConfigError
from depthmix.pretrain import checkpoint as ckpt
from depthmix.pretrain import save_guard
from depthmix.pretrain.callbacks.base import Callback
from depthmix.pretrain.run_log import say

log = logging.getLogger("depthmix")


def save_dir(run) -> str:
    return ckpt.default_save_dir(run)


class CheckpointCallback(Callback):
    """Owns ``trainer.save_dir`` and ``trainer.resumed_from``.

    Resume rule: the save directory's latest checkpoint if there is one (this run's own
    progress: a requeued or re-run job continues, loading everything), else
    ``train.load_dir`` if given (it must hold a checkpoint; ``train.load_weights_only=true``
    takes only its weights), else a fresh start. Within a directory: the newest healthy
    checkpoint whose files are intact (``checkpoint.resume_candidates``, ``first_intact``);
    its model record must match the run (``checkpoint.check_record``).

    Put it **last** in the callback list (before :class:`PreemptionCallback`): its
    ``post_step`` then saves the state after the other callbacks acted on the step, so a
    resumed run replays exactly what follows. (Its ``setup`` restores the step, data
    position and RNG before the data is built; other callbacks' ``setup`` must not depend
    on the restored state.)
    """

    def __init__(self):
        self.last_saved_step: Optional[int] = None
        self.guard: Optional[save_guard.SaveGuard] = None

    def setup(self, trainer) -> None:
        t = trainer.run.train
        trainer.save_dir = save_dir(trainer.run)
        trainer.resumed_from = None
        # lock, writable, room for a checkpoint: refused now rather than at the first save
        self.guard = save_guard.SaveGuard.start(trainer, trainer.save_dir)
        candidates = ckpt.resume_candidates(trainer.save_dir)
        weights_only, source = False, f"train.save_dir={trainer.save_dir}"
        if not candidates and t.load_dir:
            candidates = ckpt.resume_candidates(t.load_dir)
            weights_only, source = t.load_weights_only, "train.load_dir"
            if not candidates:
                raise ConfigError(f"train.load_dir={t.load_dir} holds no checkpoint "
                                  f"(no {ckpt.TRACKER} and no {ckpt.META})")
        if not candidates:
            return
        path = ckpt.first_intact(candidates, t.ckpt_integrity)
        if path is None:
            raise RuntimeError(f"every checkpoint to resume from is damaged: "
                               f"{', '.join(candidates)} (see the warnings above)")
        ckpt.check_record(path, trainer.run, weights_only, source)
        meta = ckpt.load(trainer, path, weights_only=weights_only)
        trainer.resumed_from = path
        if not weights_only:
            self.last_saved_step = trainer.step
        if trainer.topo.is_logging_rank:
            say(f"resumed from {path} at step {meta['step']}"
                + (" (weights only)" if weights_only else ""))

    def post_restore(self, trainer) -> None:
        self.last_saved_step = trainer.step  # a rollback loaded the checkpoint of this step

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

    def close(self, trainer) -> None:
        if self.guard is not None:
            self.guard.close()  # the save_dir lock
