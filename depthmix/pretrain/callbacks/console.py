"""One log line per interval, from the single rank that sees the loss."""

from __future__ import annotations

import math

from depthmix.pretrain.callbacks.base import Callback


class ConsoleLogger(Callback):
    def __init__(self, printer=print):
        self.printer = printer
        self._seconds = 0.0
        self._steps = 0

    def _emit(self, trainer, text: str) -> None:
        if trainer.topo.is_logging_rank:
            self.printer(text, flush=True) if self.printer is print else self.printer(text)

    def post_step(self, trainer, result) -> None:
        self._seconds += getattr(result, "seconds", 0.0)
        self._steps += 1
        t = trainer.run.train
        if trainer.step % t.log_interval and trainer.step not in (1, t.steps):
            return
        per_step = self._seconds / max(self._steps, 1)
        tokens_per_s = trainer.tokens_per_step / per_step if per_step else 0.0
        grad = f"{result.grad_norm:.3f}" if result.grad_norm is not None else "-"
        self._emit(
            trainer,
            f"step {trainer.step:>6}/{t.steps} | loss {result.loss:.4f} | lr {result.lr:.3e} "
            f"| grad {grad} | scale {result.loss_scale:g} | {tokens_per_s:,.0f} tok/s "
            f"| {per_step:.3f} s/step" + (" | skipped" if result.skipped else ""),
        )
        self._seconds, self._steps = 0.0, 0

    def post_eval(self, trainer, result) -> None:
        ppl = math.exp(min(result.loss, 50))
        self._emit(trainer, f"eval step {trainer.step:>6} | loss {result.loss:.4f} | ppl {ppl:.2f}")
