"""Numerical health of a run: non-finite steps and loss spikes, and what is done about them.

Every step, before the optimizer update, the loss (all-reduced over all ranks) and the
gradient norm (all-reduced over the ranks that hold gradients; data-parallel replicas hold
the same gradients) are known on every rank, bit-identical. :meth:`HealthGuard.check`
decides from them alone, so every rank takes the same decision with no extra collective.

* **Non-finite step**: NaN/inf loss or gradient norm; in fp16 also an overflow while the
  loss scale is already at ``train.min_loss_scale`` (dynamic loss scaling can do nothing
  more; an overflow above the floor is ordinary loss scaling and is not counted). Its
  update is never applied (``step.optimizer_step``); ``train.on_nonfinite`` then says
  what follows: ``skip`` (go on with the next batch), ``stop``, ``rollback``.
* **Loss spike** (``train.spike_zscore``): the loss is more than that many standard
  deviations above the mean of the last ``train.spike_window`` applied steps.
  ``train.on_spike=log`` warns; ``skip``/``rollback`` veto the update like a non-finite
  step.
* ``train.max_nonfinite_steps`` such steps in a row (a rollback keeps the count until
  training gets past the step that failed) stop the run: :class:`TrainingDiverged`,
  exit status 3 from ``depthmix-train`` (:data:`depthmix.runtime.exit_codes.DIVERGED`).
* **Rollback**: reload the newest healthy, intact checkpoint of the save directory
  (weights, optimizer, schedule, RNG) and continue with the data *after* the window that
  led to the failure (the data position is not rewound).

Each checkpoint records :meth:`HealthGuard.mark` (``health`` in ``depthmix.json``);
retention and resume use it (``checkpoint.py``).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Optional

from depthmix.pretrain.step import OVERFLOW

log = logging.getLogger("depthmix")

NONFINITE_LOSS = "non-finite loss"
NONFINITE_GRAD = "non-finite gradient norm"
SPIKE = "loss spike"


class TrainingDiverged(RuntimeError):
    """The run stopped because it diverged (``train.on_nonfinite=stop`` or
    ``train.max_nonfinite_steps`` bad steps in a row)."""


def _warn(trainer, *args) -> None:
    """Every rank takes the same decisions; one of them says so."""
    topo = getattr(trainer, "topo", None)
    if topo is None or topo.is_logging_rank:
        log.warning(*args)


def _finite(x: Optional[float]) -> bool:
    return x is None or math.isfinite(x)


def _json_number(x: Optional[float]):
    """Plain JSON: non-finite values as strings ("nan", "inf")."""
    return x if x is None or math.isfinite(x) else str(x)


class HealthGuard:
    def __init__(self, train_cfg):
        self.t = train_cfg
        self.window = deque(maxlen=train_cfg.spike_window)
        self.total = 0
        """Non-finite steps in this process."""
        self.spikes = 0
        self.rollbacks = 0
        self.in_a_row = 0
        self._last_bad_step: Optional[int] = None
        self._pending: Optional[tuple] = None
        self._unconfirmed: Optional[str] = None
        """The checkpoint saved after the last step, until the next step settles it."""

    def zscore(self, loss: float) -> Optional[float]:
        """How unusual ``loss`` is against the window (None while it is filling)."""
        if self.t.spike_zscore is None or len(self.window) < self.window.maxlen:
            return None
        mean = math.fsum(self.window) / len(self.window)
        var = math.fsum((x - mean) ** 2 for x in self.window) / (len(self.window) - 1)
        return (loss - mean) / math.sqrt(var) if var > 0 else None

    def _is_spike(self, loss: float) -> bool:
        z = self.zscore(loss) if math.isfinite(loss) else None
        return z is not None and z > self.t.spike_zscore

    def check(self, loss: float, grad_norm: float) -> Optional[str]:
        """Before the update: why it must not be applied (None: apply it)."""
        if not math.isfinite(loss):
            return NONFINITE_LOSS
        if not math.isfinite(grad_norm):
            return NONFINITE_GRAD
        if self.t.on_spike != "log" and self._is_spike(loss):
            return SPIKE
        return None

    def observe(self, trainer, result) -> None:
        """After the step: classify and count it; what follows happens in :meth:`act`,
        after the callbacks have seen (logged, saved) the step."""
        t = self.t
        nonfinite = result.rejected in (NONFINITE_LOSS, NONFINITE_GRAD) or (
            result.rejected == OVERFLOW
            and (not math.isfinite(result.loss) or result.scale_used <= t.min_loss_scale))
        spike = result.rejected == SPIKE or (result.rejected is None
                                             and self._is_spike(result.loss))
        result.nonfinite = nonfinite
        if self._unconfirmed is not None and (nonfinite or result.rejected is None):
            self._settle(trainer, nonfinite)
        self.total += nonfinite
        self.spikes += spike
        result.nonfinite_steps = self.total
        if spike and result.rejected is None:
            _warn(trainer, "step %d: loss spike %.4f (z-score %.1f > train.spike_zscore=%g "
                  "over the last %d steps)", trainer.step, result.loss,
                  self.zscore(result.loss), t.spike_zscore, len(self.window))
        if result.rejected is None:
            self.window.append(result.loss)
            if self._last_bad_step is None or trainer.step > self._last_bad_step:
                self.in_a_row = 0
            return
        if not (nonfinite or spike):
            return  # an ordinary fp16 overflow: the loss scaler handles it
        self.in_a_row += 1
        self._last_bad_step = max(self._last_bad_step or 0, trainer.step)
        reason = result.rejected if result.rejected != OVERFLOW else (
            NONFINITE_LOSS if not math.isfinite(result.loss)
            else f"fp16 overflow at the minimum loss scale {result.scale_used:g}")
        policy, option = ((t.on_nonfinite, "on_nonfinite") if nonfinite
                          else (t.on_spike, "on_spike"))
        _warn(trainer, "step %d: %s (loss %s, grad norm %s): update not applied, %d in a row",
              trainer.step, reason, result.loss, result.grad_norm, self.in_a_row)
        if policy == "stop":
            self._pending = ("stop", f"step {trainer.step}: {reason} (train.{option}=stop)")
        elif self.in_a_row >= t.max_nonfinite_steps:
            self._pending = ("stop", f"step {trainer.step}: {self.in_a_row} non-finite or "
                                     f"vetoed steps in a row (train.max_nonfinite_steps="
                                     f"{t.max_nonfinite_steps}); last: {reason}")
        elif policy == "rollback":
            self._pending = ("rollback", reason)

    def saved(self, trainer, path: str) -> None:
        """A checkpoint of the current state was published (``checkpoint.save``)."""
        self._unconfirmed = path if self.mark(trainer)["healthy"] else None

    def _settle(self, trainer, failed: bool) -> None:
        """The step after a save tells whether the saved weights were good."""
        import torch.distributed as dist

        from depthmix.checkpoint import distributed as ckpt

        path, self._unconfirmed = self._unconfirmed, None
        if failed:
            _warn(trainer, "step %d, the first after checkpoint %s, was non-finite: that "
                  "checkpoint is marked unhealthy", trainer.step, path)
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        try:
            if failed:
                ckpt.set_health(path, healthy=False, confirmed=False,
                                note=f"step {trainer.step} after it was non-finite")
            else:
                ckpt.set_health(path, confirmed=True)
        except OSError as e:
            log.warning("could not update the health mark of %s: %s", path, e)

    def act(self, trainer) -> None:
        """After the step's callbacks: stop (raise :class:`TrainingDiverged`) or roll back."""
        if self._pending is None:
            return
        what, reason = self._pending
        self._pending = None
        if what == "stop":
            raise TrainingDiverged(
                f"training diverged at {reason}. Resume from the newest healthy checkpoint "
                "with a lower train.lr (or a larger train.warmup_fraction)")
        self.rollback(trainer, reason)

    def rollback(self, trainer, reason: str) -> bool:
        """Collective: reload the newest healthy intact checkpoint, keep the data position."""
        from depthmix.checkpoint import distributed as ckpt

        root = trainer.state.save_dir
        candidates = [p for p in ckpt.resume_candidates(root, warn=False) if ckpt.is_healthy(p)] \
            if root else []
        path = ckpt.first_intact(candidates, self.t.ckpt_integrity) if candidates else None
        if path is None:
            _warn(trainer, "step %d: %s, but no healthy checkpoint in %s to roll back to: "
                  "the step is skipped instead", trainer.step, reason, root)
            return False
        failed_at, position = trainer.step, trainer.consumed_samples
        self._unconfirmed = None
        trainer.load_checkpoint(path)
        skipped = position - trainer.consumed_samples
        trainer.consumed_samples = position  # continue after the data window that failed
        self.rollbacks += 1
        for cb in trainer.callbacks:
            cb.post_restore(trainer)
        if trainer.topo.is_logging_rank:
            from depthmix.runtime.log import say

            say(f"rolled back from step {failed_at} ({reason}) to {path}; skipping the "
                f"{skipped} samples since")
        return True

    def mark(self, trainer) -> dict:
        """The health record of a checkpoint of ``trainer``'s current state: healthy when
        the last step's loss and gradient norm were finite; ``confirmed`` later by
        :meth:`_settle`."""
        last = getattr(trainer, "last", None)
        loss = last.loss if last is not None else None
        grad_norm = last.grad_norm if last is not None else None
        healthy = last is None or (_finite(loss) and _finite(grad_norm)
                                   and not getattr(last, "nonfinite", False))
        return {"healthy": healthy, "confirmed": False, "loss": _json_number(loss),
                "grad_norm": _json_number(grad_norm), "nonfinite_steps": self.total,
                "rollbacks": self.rollbacks}
