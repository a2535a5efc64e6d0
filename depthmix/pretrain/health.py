"""Numerical health of a run: non-finite steps and loss spikes, and the verdict on each step.

Every step, before the optimizer update, the loss (all-reduced over all ranks) and the
gradient norm (all-reduced over the ranks that hold gradients; data-parallel replicas hold
the same gradients) are known on every rank, bit-identical. :class:`HealthGuard` decides
from them alone, so every rank reaches the same verdict with no extra collective; the
trainer acts on it.

* **Non-finite step**: NaN/inf loss or gradient norm; in fp16 also an overflow while the
  loss scale is already at ``train.min_loss_scale`` (dynamic loss scaling can do nothing
  more; an overflow above the floor is ordinary loss scaling and is not counted). Its
  update is never applied (:meth:`HealthGuard.check`, ``step.optimizer_step``);
  ``train.on_nonfinite`` then says what follows: ``skip`` (go on with the next batch),
  ``stop``, ``rollback``.
* **Loss spike** (``train.spike_zscore``): the loss is more than that many standard
  deviations above the mean of the last ``train.spike_window`` applied steps.
  ``train.on_spike=log`` warns; ``skip``/``rollback`` veto the update like a non-finite
  step.
* ``train.max_nonfinite_steps`` such steps in a row (a rollback keeps the count until
  training gets past the step that failed) stop the run: :class:`TrainingDiverged`,
  exit status 3 from ``depthmix-train`` (:data:`depthmix.runtime.exit_codes.DIVERGED`).
* **Rollback** (the trainer's): reload the newest healthy, intact checkpoint of the save
  directory (weights, optimizer, schedule, RNG) and continue with the data *after* the
  window that led to the failure (the data position is not rewound).

Each checkpoint records :meth:`HealthGuard.mark` (``health`` in ``depthmix.json``);
retention and resume use it (:mod:`depthmix.checkpoint.store`).
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

from depthmix.pretrain.step import OVERFLOW

log = logging.getLogger("depthmix")

NONFINITE_LOSS = "non-finite loss"
NONFINITE_GRAD = "non-finite gradient norm"
SPIKE = "loss spike"


class TrainingDiverged(RuntimeError):
    """The run stopped because it diverged (``train.on_nonfinite=stop`` or
    ``train.max_nonfinite_steps`` bad steps in a row)."""


class Action(enum.Enum):
    APPLY = "apply"
    """The update was applied."""
    SKIP = "skip"
    """The update was not applied; go on with the next batch."""
    ROLLBACK = "rollback"
    """Not applied; reload the newest healthy checkpoint, keep the data position."""
    STOP = "stop"
    """Not applied; raise :class:`TrainingDiverged` with the verdict's reason."""


@dataclass(frozen=True)
class Verdict:
    """:meth:`HealthGuard.observe`'s ruling on one step, acted on by the trainer after the
    callbacks have seen (logged, saved) the step."""

    action: Action
    reason: Optional[str] = None
    """Why the update was not applied (for ``STOP``: the whole message)."""
    nonfinite: bool = False
    """Counted as a non-finite step: the checkpoint saved before it is demoted."""


def _finite(x: Optional[float]) -> bool:
    return x is None or math.isfinite(x)


def _json_number(x: Optional[float]):
    """Plain JSON: non-finite values as strings ("nan", "inf")."""
    return x if x is None or math.isfinite(x) else str(x)


class HealthGuard:
    """The loss window and the counts of non-finite steps, spikes and rollbacks of this
    process. ``logging_rank``: this rank says what it decided (every rank decides alike)."""

    def __init__(self, train_cfg, logging_rank: bool = True):
        self.t = train_cfg
        self.logging_rank = logging_rank
        self.window = deque(maxlen=train_cfg.spike_window)
        self.total = 0
        """Non-finite steps in this process."""
        self.spikes = 0
        self.rollbacks = 0
        self.in_a_row = 0
        self._last_bad_step: Optional[int] = None

    def _warn(self, *args) -> None:
        if self.logging_rank:
            log.warning(*args)

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

    def observe(self, step: int, result) -> Verdict:
        """After step ``step`` (its :class:`~depthmix.pretrain.step.StepResult`): classify
        and count it, and rule what follows."""
        t = self.t
        skipped = result.skipped
        nonfinite = skipped in (NONFINITE_LOSS, NONFINITE_GRAD) or (
            skipped == OVERFLOW
            and (not math.isfinite(result.loss) or result.scale_used <= t.min_loss_scale))
        spike = skipped == SPIKE or (skipped is None and self._is_spike(result.loss))
        self.total += nonfinite
        self.spikes += spike
        if spike and skipped is None:
            self._warn("step %d: loss spike %.4f (z-score %.1f > train.spike_zscore=%g over "
                       "the last %d steps)", step, result.loss, self.zscore(result.loss),
                       t.spike_zscore, len(self.window))
        if skipped is None:
            self.window.append(result.loss)
            if self._last_bad_step is None or step > self._last_bad_step:
                self.in_a_row = 0
            return Verdict(Action.APPLY)
        if not (nonfinite or spike):
            return Verdict(Action.SKIP, skipped)  # an ordinary fp16 overflow: the scaler's
        self.in_a_row += 1
        self._last_bad_step = max(self._last_bad_step or 0, step)
        reason = skipped if skipped != OVERFLOW else (
            NONFINITE_LOSS if not math.isfinite(result.loss)
            else f"fp16 overflow at the minimum loss scale {result.scale_used:g}")
        policy, option = ((t.on_nonfinite, "on_nonfinite") if nonfinite
                          else (t.on_spike, "on_spike"))
        self._warn("step %d: %s (loss %s, grad norm %s): update not applied, %d in a row",
                   step, reason, result.loss, result.grad_norm, self.in_a_row)
        if policy == "stop":
            return _stop(f"step {step}: {reason} (train.{option}=stop)", nonfinite)
        if self.in_a_row >= t.max_nonfinite_steps:
            return _stop(f"step {step}: {self.in_a_row} non-finite or vetoed steps in a row "
                         f"(train.max_nonfinite_steps={t.max_nonfinite_steps}); last: {reason}",
                         nonfinite)
        if policy == "rollback":
            return Verdict(Action.ROLLBACK, reason, nonfinite)
        return Verdict(Action.SKIP, reason, nonfinite)

    def rolled_back(self) -> None:
        """The trainer reloaded a checkpoint after a ``ROLLBACK`` verdict."""
        self.rollbacks += 1

    def mark(self, last) -> dict:
        """The health record of a checkpoint saved after the step ``last`` (a
        :class:`~depthmix.pretrain.step.StepResult`, None before the first): healthy when its
        loss and gradient norm were finite; ``confirmed`` later, by the next step."""
        loss = last.loss if last is not None else None
        grad_norm = last.grad_norm if last is not None else None
        healthy = last is None or (_finite(loss) and _finite(grad_norm) and not last.nonfinite)
        return {"healthy": healthy, "confirmed": False, "loss": _json_number(loss),
                "grad_norm": _json_number(grad_norm), "nonfinite_steps": self.total,
                "rollbacks": self.rollbacks}


def _stop(reason: str, nonfinite: bool) -> Verdict:
    return Verdict(Action.STOP, f"training diverged at {reason}. Resume from the newest "
                                "healthy checkpoint with a lower train.lr (or a larger "
                                "train.warmup_fraction)", nonfinite)
