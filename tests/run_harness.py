"""Helpers for the operations tests: run a function in a group of gloo processes, record
what a training run did, fingerprint the random generators."""

from __future__ import annotations

import copy
import hashlib
import os
import random
import subprocess

import numpy as np
import torch

from cli_processes import PYTHON, REPO, clean_env, run  # noqa: F401 (PYTHON, REPO: for users)
from depthmix.pretrain.callbacks import Callback
from depthmix import testing
from depthmix.testing import SyntheticData, tiny_run

env_for_subprocess = clean_env


def spawn(target, world_size: int, args=(), timeout: float = 240.0) -> list:
    """:func:`depthmix.testing.spawn` with W&B kept quiet."""
    return testing.spawn(target, world_size, args, timeout, env={"WANDB_SILENT": "true"})


def rng_draws() -> tuple:
    """Advance every generator a checkpoint must restore, returning what was drawn."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker = torch.rand(1).item()
    return (random.random(), float(np.random.rand()), torch.rand(1).item(), tracker)


class Recorder(Callback):
    """Per step: loss, grad norm, lr, loss scale, and one draw from every generator."""

    def __init__(self):
        self.steps = []

    def post_step(self, trainer, result) -> None:
        self.steps.append({"step": trainer.step, "loss": result.loss,
                           "grad_norm": result.grad_norm, "lr": result.lr,
                           "loss_scale": result.loss_scale, "rng": rng_draws(),
                           "consumed": trainer.consumed_samples})


class FaultyData(SyntheticData):
    """:class:`SyntheticData` with faults by training step (1-based, counted from the data
    position it was built at): the batches of ``nan_steps`` make the loss and gradients NaN
    (two opposite huge loss-mask entries: inf - inf, while the token count stays finite),
    those of ``drop_steps`` are left out (a reference run that never saw them);
    ``nan_dp_ranks``: the data-parallel ranks whose share is NaN (default all). Pass
    ``functools.partial(FaultyData, nan_steps=...)`` as ``data``."""

    def __init__(self, run, dp_rank=0, dp_size=1, consumed=0, nan_steps=(), drop_steps=(),
                 nan_dp_ranks=None):
        super().__init__(run, dp_rank, dp_size, consumed)
        if nan_dp_ranks is not None and dp_rank not in nan_dp_ranks:
            nan_steps = ()
        t = run.train
        per_step = t.global_batch_size // (t.micro_batch_size * dp_size)
        self.train_iterator = self._faulty(self.train_iterator, per_step,
                                           consumed // t.global_batch_size, nan_steps, drop_steps)

    @staticmethod
    def _faulty(batches, per_step, step, nan_steps, drop_steps):
        while True:
            step += 1
            micro = [next(batches) for _ in range(per_step)]
            if step in drop_steps:
                continue
            for batch in micro:
                if step in nan_steps:
                    mask = batch["loss_mask"].clone()
                    mask[0, 0], mask[0, 1] = 3e38, -3e38
                    batch = {**batch, "loss_mask": mask}
                yield batch


def make_run(steps: int = 6, **parallel):
    run = tiny_run()
    t = run.train
    t.micro_batch_size, t.global_batch_size = 2, 8
    t.steps, t.lr, t.warmup_fraction = steps, 1e-2, 0.2
    t.eval_interval, t.log_interval = 0, 1
    run.logger.wandb, run.logger.mode, run.logger.progress = False, "disabled", False
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    return run


def trainer_saving_to(save_dir: str, callbacks, **train):
    """A Trainer of :func:`make_run` (``steps``: 6 unless given) saving to ``save_dir``
    (its run directory the parent), ``data`` (default synthetic) and the other ``train``
    options set on ``run.train``."""
    from depthmix.pretrain.trainer import Trainer

    data = train.pop("data", SyntheticData)
    run = make_run(steps=train.pop("steps", 6))
    run.output_dir = os.path.dirname(save_dir)
    run.train.save_dir = save_dir
    for key, value in train.items():
        setattr(run.train, key, value)
    return Trainer(run, data=data, callbacks=callbacks)


def train(run, callbacks=(), data=SyntheticData) -> tuple:
    """Build a Trainer (synthetic data at the restored position), train, tear down
    Megatron's parallel state. Returns (recorded steps, trainer facts)."""
    from depthmix.pretrain.parallelize import destroy_model_parallel
    from depthmix.pretrain.trainer import Trainer

    recorder = Recorder()
    trainer = Trainer(copy.deepcopy(run), data=data, callbacks=[recorder, *callbacks])
    facts = {"start_step": trainer.step, "resumed_from": trainer.state.resumed_from,
             "params": sum(p.numel() for chunk in trainer.model for p in chunk.parameters()),
             "pp_rank": trainer.topo.pp_rank}
    try:
        trainer.train()
    finally:
        trainer.close()
    facts["stop_reason"] = trainer.stop_reason
    facts["end_step"] = trainer.step
    del trainer
    destroy_model_parallel()
    return recorder.steps, facts


def run_cli(args, cwd, timeout=240, env=None) -> subprocess.CompletedProcess:
    """``python -m depthmix.cli.train <args>`` in ``cwd``; output captured, not checked."""
    return run("depthmix-train", args, cwd=cwd, env=env, timeout=timeout, check=False)


def digest(obj) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]
