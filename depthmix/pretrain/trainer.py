"""The training loop: build everything, step, evaluate, and hand events to callbacks."""

from __future__ import annotations

import logging
import os
import random
import time
from typing import List, Optional

import numpy as np
from megatron.core.distributed import finalize_model_grads

from depthmix.checkpoint import distributed, resume, store
from depthmix.config.schema import RunConfig
from depthmix.megatron_ext.config import to_transformer_config
from depthmix.mixers import mixer_of
from depthmix.planning.flops import ThroughputMeter
from depthmix.pretrain import overlap
from depthmix.pretrain.callbacks import Callback, ConsoleLogger
from depthmix.pretrain.experts import ExpertMeter
from depthmix.pretrain.health import Action, HealthGuard, TrainingDiverged, Verdict
from depthmix.pretrain.optim import build_optimizer
from depthmix.pretrain.parallelize import build_model, init_distributed
from depthmix.pretrain.preflight import preflight
from depthmix.pretrain.state import TrainState
from depthmix.pretrain.step import StepResult, eval_step, take, train_step
from depthmix.runtime import entry_point
from depthmix.runtime.device import device_name
from depthmix.runtime.log import say

log = logging.getLogger("depthmix")


class Trainer:
    """Owns the model chunks, optimizer, schedule, data and callbacks of one run."""

    @entry_point  # from Python too: the runtime (the CPU shim where CUDA is absent) first
    def __init__(self, run: RunConfig, data=None, callbacks: Optional[List[Callback]] = None):
        """``data``: None (``depthmix.data.build_data``), a data object (``train_iterator``,
        ``valid_iterator()``), or a builder with ``build_data``'s signature
        ``(run, dp_rank, dp_size, consumed_train_samples)``, called after callbacks have
        restored a checkpoint's data position."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        # before any process group or model exists; data options only matter when the
        # data comes from them
        preflight(run, world_size, data=data is None)
        self.run = run
        self.topo = init_distributed(run)
        overlap.resolve(run.parallel, self.topo.dp)
        self.health = HealthGuard(run.train, logging_rank=self.topo.is_logging_rank)
        self._agree_on_output_dir()
        # Python/NumPy generators as Megatron-LM seeds them (torch's: init_distributed)
        random.seed(run.train.seed + 100 * self.topo.pp_rank)
        np.random.seed(run.train.seed + 100 * self.topo.pp_rank)
        self.config = to_transformer_config(run)
        self.mixer = mixer_of(run)
        """The run's :class:`~depthmix.mixers.base.Mixer`, handed to what builds and plans."""
        self.model = build_model(run, self.mixer, self.config, self.topo)
        self.optimizer, self.scheduler = build_optimizer(run, self.config, self.model)
        self._wire_megatron_hooks()

        t = run.train
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * self.topo.dp)
        self.meter = ThroughputMeter.of(run, self.mixer, self.config, self.topo.world_size,
                                        device_name())
        self.experts = (ExpertMeter(self.model, self.config, self.topo.tp, self.topo.dp)
                        if self.config.num_moe_experts else None)
        self.last: Optional[StepResult] = None
        self.verdict: Optional[Verdict] = None
        """The health verdict on the last step, acted on after the callbacks saw it."""
        self.state = TrainState.fresh(store.default_save_dir(run))
        self.resume()  # before the callbacks and the data, which start from its state
        self.callbacks = list(callbacks) if callbacks is not None else [ConsoleLogger()]
        for cb in self.callbacks:
            cb.setup(self)
        if data is None:
            from depthmix.data import build_data

            data = build_data
        if not hasattr(data, "train_iterator"):
            data = data(run, self.topo.dp_rank, self.topo.dp, self.consumed_samples)
        self.data = data
        self.stop_reason: Optional[str] = None
        """Set by :meth:`request_stop` (e.g. preemption); the loop ends after this step."""

    def _agree_on_output_dir(self) -> None:
        """Every rank uses rank 0's output directory (launchers may start ranks at different
        times, and a timestamped directory would then differ), and it exists on every rank
        (Hydra makes only its own job directory; ``output_dir=`` may name another)."""
        import torch.distributed as dist

        if self.topo.world_size > 1:
            box = [self.run.output_dir]
            dist.broadcast_object_list(box, src=0)
            if box[0] != self.run.output_dir:
                log.warning("output_dir %s differs from rank 0's; using %s",
                            self.run.output_dir, box[0])
                self.run.output_dir = box[0]
        os.makedirs(self.run.output_dir, exist_ok=True)

    def request_stop(self, reason: str) -> None:
        """End training after the current step (collective decisions only: every rank must
        call it at the same step)."""
        self.stop_reason = reason

    def _wire_megatron_hooks(self) -> None:
        config = self.config
        overlap.wire(config, self.model, self.run.parallel, self.topo.dp)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss

    # ---- state --------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def consumed_samples(self) -> int:
        return self.state.consumed_samples

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self.state.consumed_samples = value

    def resume(self) -> None:
        """Continue from the save directory's checkpoint, else ``train.load_dir``'s (see
        :func:`~depthmix.checkpoint.resume.resume_point`), else start fresh."""
        point = resume.resume_point(self.run, self.state.save_dir)
        if point is None:
            return
        path, weights_only = point
        loaded = self.load_checkpoint(path, weights_only=weights_only)
        if self.topo.is_logging_rank:
            say(f"resumed from {path} at step {loaded.meta['step']}"
                + (" (weights only)" if weights_only else ""))

    def load_checkpoint(self, path: str, weights_only: bool = False) -> distributed.Loaded:
        """Collective: restore the model (and unless ``weights_only`` the optimizer, schedule,
        RNG and data position) from the checkpoint directory ``path``."""
        loaded = distributed.load(path, run=self.run, model=self.model, topo=self.topo,
                                  optimizer=self.optimizer, scheduler=self.scheduler,
                                  weights_only=weights_only)
        if loaded.step is not None:
            self.state.step, self.state.consumed_samples = loaded.step, loaded.consumed_samples
        self.state.resumed_from, self.state.weights_only = path, loaded.weights_only
        return loaded

    def save_checkpoint(self, root: Optional[str] = None, keep_last: int = 2,
                        estimate: Optional[int] = None, extra_meta: Optional[dict] = None,
                        background=None) -> str:
        """Collective: save the current state under ``root`` (default the run's save
        directory); returns the checkpoint's path. With ``background`` (a
        :class:`~depthmix.checkpoint.background.BackgroundSaves`) the write is handed to it
        and the checkpoint appears at that path once it publishes it."""
        tokenizer = getattr(getattr(getattr(self, "data", None), "tokenizer", None), "path", None)
        health = self.health.mark(self.last)
        overlap.sync_params(self.model)  # the weights the last update made, whole
        save = dict(run=self.run, model=self.model, optimizer=self.optimizer,
                    scheduler=self.scheduler, topo=self.topo, step=self.step,
                    consumed_samples=self.consumed_samples, keep_last=keep_last,
                    estimate=estimate, health=health, tokenizer=tokenizer,
                    extra_meta=extra_meta)
        root = root or self.state.save_dir
        if background is not None:
            background.start(root, **save)
            return background.pending_path()
        path = distributed.save(root, **save)
        self.state.unconfirmed = path if health["healthy"] else None
        return path

    def _settle_checkpoint(self, finite: bool) -> None:
        """The first step after a save is the first to use its weights: it confirms the
        checkpoint, or demotes it when it was non-finite (retention and rollback then go
        further back)."""
        path, self.state.unconfirmed = self.state.unconfirmed, None
        if not finite and self.topo.is_logging_rank:
            log.warning("step %d, the first after checkpoint %s, was non-finite: that "
                        "checkpoint is marked unhealthy", self.step, path)
        if self.topo.rank == 0:
            store.settle_health(path, self.step, finite)

    def roll_back(self, reason: str) -> bool:
        """Collective: reload the newest healthy intact checkpoint of the save directory and
        keep the data position (continue after the window that failed). False when there is
        none: the step is skipped instead."""
        path = resume.rollback_point(self.state.save_dir, self.run.train.ckpt_integrity)
        if path is None:
            if self.topo.is_logging_rank:
                log.warning("step %d: %s, but no healthy checkpoint in %s to roll back to: "
                            "the step is skipped instead", self.step, reason,
                            self.state.save_dir)
            return False
        failed_at, position = self.step, self.consumed_samples
        self.state.unconfirmed = None
        self.load_checkpoint(path)
        skipped = position - self.consumed_samples
        self.consumed_samples = position
        self.health.rolled_back()
        for cb in self.callbacks:
            cb.post_restore(self)
        if self.topo.is_logging_rank:
            say(f"rolled back from step {failed_at} ({reason}) to {path}; skipping the "
                f"{skipped} samples since")
        return True

    # ---- steps ----------------------------------------------------------------------------
    def is_log_step(self) -> bool:
        """The first, every ``train.log_interval``-th and the last step."""
        t = self.run.train
        return self.step in (1, t.steps) or self.step % t.log_interval == 0

    def train_one_step(self, after_backward=None) -> StepResult:
        t0 = time.perf_counter()
        batches = take(self.data.train_iterator, self.num_microbatches)
        result = train_step(self.model, self.optimizer, self.scheduler, batches,
                            self.run.model.seq_length, force_all_reduce=after_backward is not None,
                            after_backward=after_backward, check=self.health.check)
        result.seconds = time.perf_counter() - t0
        self.step += 1
        self.consumed_samples += self.run.train.global_batch_size
        self.meter.add(result.seconds)
        if self.experts is not None:
            self.experts.add_step(self.num_microbatches)
        if self.is_log_step():
            result.perf = self.meter.read()
            if self.experts is not None:
                result.experts = self.experts.read()  # collective
        self.verdict = self.health.observe(self.step, result)
        result.nonfinite = self.verdict.nonfinite
        result.nonfinite_steps = self.health.total
        if self.state.unconfirmed is not None and (
                result.nonfinite or self.verdict.action is Action.APPLY):
            self._settle_checkpoint(finite=not result.nonfinite)
        self.last = result
        return result

    def evaluate(self) -> StepResult:
        overlap.sync_params(self.model)
        iterator = self.data.valid_iterator()
        results = []
        for i in range(self.run.train.eval_iters):
            results.append(eval_step(self.model, take(iterator, self.num_microbatches),
                                     self.run.model.seq_length))
            for cb in self.callbacks:
                cb.post_eval_batch(self, i)
            if self.stop_reason is not None:  # e.g. preempted: save now, not after the eval
                break
        tokens = sum(r.tokens for r in results)
        loss = sum(r.loss * r.tokens for r in results) / max(tokens, 1)
        return StepResult(loss=loss, tokens=tokens)

    def should_stop(self, steps_this_run: int) -> bool:
        t = self.run.train
        if self.stop_reason is not None or self.step >= t.steps:
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
            if self.verdict.action is Action.STOP:  # after the callbacks logged the step
                raise TrainingDiverged(self.verdict.reason)
            if self.verdict.action is Action.ROLLBACK:
                self.roll_back(self.verdict.reason)
            if t.eval_interval and self.step % t.eval_interval == 0 and self.stop_reason is None:
                self._run_eval()  # not while being preempted: save first
        if (t.eval_interval and self.step % t.eval_interval and self.step >= t.steps
                and self.stop_reason is None):
            self._run_eval()
        overlap.sync_params(self.model)
        for cb in self.callbacks:
            cb.post_train(self)

    def _run_eval(self) -> None:
        result = self.evaluate()
        if self.stop_reason is not None:
            return  # stopped inside the evaluation: a partial result is not reported
        for cb in self.callbacks:
            cb.post_eval(self, result)

    def on_error(self, exc: BaseException) -> None:
        for cb in self.callbacks:
            cb.on_error(self, exc)

    def close(self) -> None:
        for cb in self.callbacks:
            cb.close(self)


def default_callbacks(run: RunConfig) -> List[Callback]:
    """Console log line, progress bar, depth statistics (and the expert-load heatmap), W&B,
    profiler, checkpoints, closing summary, preemption. Checkpoints come after the loggers:
    their ``post_step`` saves the state *after* the others acted on the step (anything they
    draw from an RNG is in the checkpoint). Depth statistics and the expert-load heatmap come
    before W&B, which logs them. The summary closes after
    W&B and before preemption, whose ``close`` hands over to submitit after everything else
    is saved and closed. Logging callbacks act on the loss rank only."""
    from depthmix.pretrain.callbacks import (
        CheckpointCallback,
        DepthStatsCallback,
        ExpertLoadHeatmap,
        PreemptionCallback,
        ProfilerCallback,
        ProgressBar,
        RunSummary,
        WandbLogger,
    )

    callbacks: List[Callback] = [ConsoleLogger()]
    if run.logger.progress:
        callbacks.append(ProgressBar())
    wandb_logger = (WandbLogger() if run.logger.wandb and run.logger.mode != "disabled"
                    else None)
    consumers = [wandb_logger] if wandb_logger else []
    if run.logger.depth_stats_interval:
        callbacks.append(DepthStatsCallback(consumers=consumers))
        if run.model.experts is not None:
            callbacks.append(ExpertLoadHeatmap(consumers=consumers))
    if wandb_logger:
        callbacks.append(wandb_logger)
    if run.train.profile_steps:
        callbacks.append(ProfilerCallback())
    callbacks.append(CheckpointCallback())
    callbacks.append(RunSummary())
    if run.train.save_on_preemption:
        callbacks.append(PreemptionCallback())
    return callbacks
