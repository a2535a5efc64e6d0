"""Loss and perplexity of a checkpoint on token datasets, at any TP/PP/VP/DP layout.

The model chunks are built as training builds them but without the training wrappers
(:func:`~depthmix.pretrain.parallelize.build_chunks`: no DDP gradient buffers, no optimizer,
no fp32 main grads) and loaded by :func:`~depthmix.checkpoint.distributed.load` with weights
only; each step is the trainer's
:func:`~depthmix.pretrain.step.eval_step` (Megatron's schedule, ``forward_only=True``) over
the windows of :mod:`depthmix.evaluate.windows`. Losses are token sums reduced over the
data-parallel ranks in fp64, so the result does not depend on the layout.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import List

from depthmix.megatron_ext.config import to_transformer_config
from depthmix.config.schema import RunConfig
from depthmix.evaluate.windows import microbatches, steps
from depthmix.mixers import mixer_of
from depthmix.checkpoint.distributed import load
from depthmix.pretrain.parallelize import build_chunks, init_distributed
from depthmix.pretrain.step import eval_step

log = logging.getLogger("depthmix")


@dataclass
class DatasetResult:
    name: str
    loss: float
    """Mean negative log-likelihood per predicted token, in nats."""
    tokens: int
    """Predicted tokens."""
    windows: int
    seconds: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(min(self.loss, 700.0))

    def as_dict(self) -> dict:
        return {"loss": self.loss, "ppl": self.ppl, "tokens": self.tokens,
                "windows": self.windows, "seconds": round(self.seconds, 3)}


def pooled(results: List[DatasetResult]) -> DatasetResult:
    """Token-weighted over datasets."""
    tokens = sum(r.tokens for r in results)
    loss = sum(r.loss * r.tokens for r in results) / max(tokens, 1)
    return DatasetResult("pooled", loss, tokens, sum(r.windows for r in results),
                         sum(r.seconds for r in results))


class Evaluator:
    """This rank's model chunks at the run's layout, with a checkpoint's weights."""

    def __init__(self, run: RunConfig, checkpoint: str):
        self.run = run
        self.topo = init_distributed(run)
        self.config = to_transformer_config(run)
        self.config.perform_initialization = False  # every weight comes from the checkpoint
        self.model = build_chunks(run, mixer_of(run), self.config, self.topo)
        self.meta = load(checkpoint, run=run, model=self.model, topo=self.topo,
                         weights_only=True).meta

    def evaluate(self, dataset, batch_size: int, num_microbatches: int) -> DatasetResult:
        """Loss over all windows of ``dataset`` (a :class:`depthmix.evaluate.job.Dataset`);
        collective, every rank returns the same result."""
        topo, s = self.topo, self.run.model.seq_length
        n_steps = steps(dataset.windows, topo.dp, batch_size, num_microbatches)
        start = time.perf_counter()
        total, tokens = 0.0, 0
        for k in range(n_steps):
            batches = microbatches(dataset.stream.tokens, dataset.windows, s, k, topo.dp_rank,
                                   topo.dp, batch_size, num_microbatches)
            result = eval_step(self.model, batches, s)
            total += result.loss * result.tokens
            tokens += result.tokens
            if topo.rank == 0 and (k + 1) % max(n_steps // 10, 1) == 0:
                log.info("%s: step %d/%d, %d tokens, loss %.4f", dataset.name, k + 1, n_steps,
                         tokens, total / max(tokens, 1))
        if tokens != dataset.predicted_tokens:
            raise RuntimeError(f"{dataset.name}: {tokens} tokens evaluated, expected "
                               f"{dataset.predicted_tokens}")
        return DatasetResult(dataset.name, total / tokens, tokens, dataset.windows,
                             time.perf_counter() - start)


def evaluate_datasets(job) -> List[DatasetResult]:
    """Every dataset of ``job`` (:class:`depthmix.evaluate.job.EvalJob`); collective."""
    evaluator = Evaluator(job.run, job.checkpoint)
    return [evaluator.evaluate(d, job.eval.batch_size, job.num_microbatches)
            for d in job.datasets]
