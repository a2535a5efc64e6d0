"""The training loop: build everything, step, evaluate, and hand events to callbacks."""

from __future__ import annotations

import logging
import os
import time
from typing import List, Optional

from megatron.core.distributed import finalize_model_grads

from depthmix.config.megatron import to_transformer_config
from depthmix.config.schema import RunConfig
from depthmix.config.validate import validate
from depthmix.pretrain.callbacks import Callback, ConsoleLogger
from depthmix.pretrain.optim import build_optimizer
from depthmix.pretrain.parallelize import build_model, init_distributed
from depthmix.pretrain.step import StepResult, eval_step, take, train_step

log = logging.getLogger("depthmix")


class Trainer:
    """Owns the model chunks, optimizer, schedule, data and callbacks of one run."""

    def __init__(self, run: RunConfig, data=None, callbacks: Optional[List[Callback]] = None):
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        validate(run, world_size)  # before any process group or model exists
        self.run = run
        self.topo = init_distributed(run)
        self.config = to_transformer_config(run)
        self.model = build_model(run, self.config, self.topo)
        self.optimizer, self.scheduler = build_optimizer(run, self.config, self.model)
        self._wire_megatron_hooks()

        t = run.train
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * self.topo.dp)
        self.step = 0
        self.consumed_samples = 0
        self.callbacks = list(callbacks) if callbacks is not None else [ConsoleLogger()]
        for cb in self.callbacks:
            cb.setup(self)  # may restore state (checkpoints) before data is built
        if data is None:
            from depthmix.data import build_data

            data = build_data(run, self.topo.dp_rank, self.topo.dp, self.consumed_samples)
        self.data = data
        self.last: Optional[StepResult] = None

    def _wire_megatron_hooks(self) -> None:
        config = self.config
        if self.run.parallel.overlap_grad_reduce:
            sync = [chunk.no_sync for chunk in self.model]
            config.no_sync_func = sync[0] if len(sync) == 1 else sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss

    @property
    def tokens_per_step(self) -> int:
        return self.run.train.global_batch_size * self.run.model.seq_length

    def train_one_step(self, after_backward=None) -> StepResult:
        t0 = time.perf_counter()
        batches = take(self.data.train_iterator, self.num_microbatches)
        result = train_step(self.model, self.optimizer, self.scheduler, batches,
                            self.run.model.seq_length, force_all_reduce=after_backward is not None,
                            after_backward=after_backward)
        result.seconds = time.perf_counter() - t0
        self.step += 1
        self.consumed_samples += self.run.train.global_batch_size
        self.last = result
        return result

    def evaluate(self) -> StepResult:
        iterator = self.data.valid_iterator()
        results = [eval_step(self.model, take(iterator, self.num_microbatches),
                             self.run.model.seq_length)
                   for _ in range(self.run.train.eval_iters)]
        tokens = sum(r.tokens for r in results)
        loss = sum(r.loss * r.tokens for r in results) / max(tokens, 1)
        return StepResult(loss=loss, tokens=tokens)

    def should_stop(self, steps_this_run: int) -> bool:
        t = self.run.train
        if self.step >= t.steps:
            return True
        return t.exit_after_steps is not None and steps_this_run >= t.exit_after_steps

    def train(self) -> None:
        t = self.run.train
        for cb in self.callbacks:
            cb.pre_train(self)
        steps_this_run = 0
        while not self.should_stop(steps_this_run):
            result = self.train_one_step()
            steps_this_run += 1
            for cb in self.callbacks:
                cb.post_step(self, result)
            if t.eval_interval and self.step % t.eval_interval == 0:
                self._run_eval()
        if t.eval_interval and self.step % t.eval_interval and self.step >= t.steps:
            self._run_eval()
        for cb in self.callbacks:
            cb.post_train(self)

    def _run_eval(self) -> None:
        result = self.evaluate()
        for cb in self.callbacks:
            cb.post_eval(self, result)

    def on_error(self, exc: BaseException) -> None:
        for cb in self.callbacks:
            cb.on_error(self, exc)

    def close(self) -> None:
        for cb in self.callbacks:
            cb.close(self)


def default_callbacks(run: RunConfig) -> List[Callback]:
    """Console logging on the loss rank (W&B and checkpoints join in their own modules)."""
    return [ConsoleLogger()]
