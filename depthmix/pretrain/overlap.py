"""Data-parallel communication overlapped with compute, wired as Megatron-LM's training loop
wires it (``megatron/training/training.py``, ``train``).

* **Gradient reduction** (``parallel.overlap_grad_reduce``): Megatron's DDP groups the
  gradients into buckets (in reverse order of the parameters, so the first bucket holds the
  last layers); a backward hook starts a bucket's all-reduce (reduce-scatter with the
  distributed optimizer) as soon as its last gradient of the last micro-batch is ready.
  ``no_sync_func`` keeps the earlier micro-batches from reducing; with pipeline parallelism
  and ``parallel.align_grad_reduce``, ``grad_sync_func`` lets the schedule launch each
  chunk's reduction (stages after the first do it in the pipeline bubble).
  ``finalize_model_grads`` waits for every bucket inside the schedule, so the loss and
  gradient norm that the health check sees, and any skip or rollback decision taken from
  them, come after every rank's reductions have finished: none is pending across a
  decision. (Megatron reduces the first step's buckets at the end of its backward: it
  learns the order in which gradients arrive from it.)
* **Parameter all-gather** (``parallel.overlap_param_gather``, distributed optimizer only):
  the optimizer step updates this rank's shard of the weights; the other shards arrive with
  the next forward, whose pre-hooks gather bucket by bucket (with
  ``parallel.align_param_gather``, the schedule dispatches them through
  ``param_sync_func``). Until then the other shards of the weights are one step old, so
  :func:`sync_params` finishes the gather before anything reads whole weights: a
  checkpoint save, an evaluation, the end of training (Megatron-LM's ``force_param_sync``).
"""

from __future__ import annotations

import functools
from typing import List, Optional

from megatron.core.distributed import DistributedDataParallelConfig

from depthmix.config.schema import Overlap, overlap_at
from depthmix.megatron_ext.model import unwrap


def settings(parallel, dp: int) -> Overlap:
    """What ``parallel`` asks for at data-parallel size ``dp`` (config.schema.overlap_at)."""
    return overlap_at(parallel, dp)


def resolve(parallel, dp: int) -> Overlap:
    """Replace ``parallel``'s automatic (None) overlap options by what they mean at ``dp``,
    so the optimizer, the checkpoint's record and the log see what runs."""
    chosen = settings(parallel, dp)
    parallel.overlap_grad_reduce = chosen.grad_reduce
    parallel.overlap_param_gather = chosen.param_gather
    return chosen


def ddp_config(parallel, dp: int) -> DistributedDataParallelConfig:
    chosen = settings(parallel, dp)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=chosen.grad_reduce,
        overlap_param_gather=chosen.param_gather,
        align_param_gather=parallel.align_param_gather,
        use_distributed_optimizer=parallel.distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=parallel.ddp_bucket_size,  # None: Megatron's max(40M, 1M x dp)
    )


def _per_chunk(funcs: List):
    return funcs[0] if len(funcs) == 1 else funcs


def wire(config, model: List, parallel, dp: int) -> None:
    """Megatron-LM's ``train``: the schedule's hooks into the DDP chunks."""
    chosen = settings(parallel, dp)
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None
    if chosen.grad_reduce:
        config.no_sync_func = _per_chunk([chunk.no_sync for chunk in model])
        if parallel.align_grad_reduce:
            config.grad_sync_func = _per_chunk([_grad_sync(chunk) for chunk in model])
    if chosen.param_gather and parallel.align_param_gather:
        config.param_sync_func = _per_chunk([chunk.start_param_sync for chunk in model])
    for chunk in model:
        if gathers_params([chunk]):
            _gather_before_each_layer(chunk)


def _grad_sync(chunk):
    """``chunk.start_grad_sync``, which drops the chunk's ``force_all_reduce`` (set by
    :func:`force_all_reduce`), honouring it."""

    def start(*unused):
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            group.start_grad_sync(force_all_reduce=chunk.force_all_reduce)

    return start


def _gather_before_each_layer(chunk) -> None:
    """Megatron's pre-hooks wait for a bucket's all-gather when a module that *directly*
    owns one of its parameters runs forward. Depth mixers read parameters of child modules
    without calling them (an AttnRes pseudo-query inside a layer, before any of the layer's
    own modules run: the first thing a later pipeline stage computes), so each decoder layer
    and each top-level part of the model also waits, before it runs, for the buckets of all
    the parameters it holds. Overlap stays at layer granularity."""
    inner = unwrap(chunk)
    units = [*inner.decoder.layers, *(m for m in inner.children() if m is not inner.decoder)]
    for unit in units:
        groups = []
        for param in unit.parameters():
            group = chunk.param_to_bucket_group.get(param)
            if group is not None and group not in groups:
                groups.append(group)
        if groups:
            unit.register_forward_pre_hook(functools.partial(_finish_gather, groups, chunk))


def _finish_gather(groups, chunk, *unused) -> None:
    for group in groups:  # as Megatron's hook: align_param_gather dispatches from the schedule
        group.finish_param_sync(skip_next_bucket_dispatch=chunk.ddp_config.align_param_gather)


def gathers_params(model: List) -> bool:
    return any(getattr(chunk, "use_forward_hook", False) for chunk in model)


def sync_params(model: List) -> None:
    """Collective: finish the overlapped parameter all-gather (wait for one in flight, or
    run it now), so every rank holds the whole updated weights. A no-op without it; the
    next forward then gathers nothing."""
    if gathers_params(model):
        for chunk in model:
            chunk.start_param_sync(force_sync=True)


def force_all_reduce(model: List, on: Optional[bool]) -> None:
    """Overlapped reductions start from backward hooks, which read the chunk's flag rather
    than the schedule's ``force_all_reduce`` argument: set both alike (full gradients on
    every rank, also with the distributed optimizer)."""
    for chunk in model:
        chunk.force_all_reduce = bool(on)
