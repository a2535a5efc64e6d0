"""Hooks the trainer calls; every method is optional."""

from __future__ import annotations


class Callback:
    def setup(self, trainer) -> None:
        """After model/optimizer exist, before data is built (restore state here)."""

    def pre_train(self, trainer) -> None:
        pass

    def post_step(self, trainer, result) -> None:
        pass

    def post_eval_batch(self, trainer, index: int) -> None:
        """After eval batch ``index`` (0-based) on every rank; may call ``request_stop``
        (collectively), which ends the evaluation after this batch."""

    def post_eval(self, trainer, result) -> None:
        pass

    def post_restore(self, trainer) -> None:
        """After a rollback replaced the trainer's state by a checkpoint's."""

    def post_train(self, trainer) -> None:
        pass

    def on_error(self, trainer, exc: BaseException) -> None:
        pass

    def close(self, trainer) -> None:
        pass
