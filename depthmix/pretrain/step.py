"""One optimizer step and one evaluation pass through Megatron's pipeline schedules."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from depthmix.planning.flops import Throughput
from depthmix.pretrain.experts import ExpertLoad
from depthmix.megatron_ext.model import unwrap
from depthmix.pretrain import overlap
from depthmix.pretrain.compile import step_begin as compile_step_begin

Batch = Dict[str, torch.Tensor]


def loss_func(loss_mask: torch.Tensor, losses: torch.Tensor):
    """Token-summed loss of one micro-batch; Megatron divides by tokens and micro-batches."""
    mask = loss_mask.float()
    loss = torch.sum(losses.float() * mask)
    tokens = mask.sum()
    return loss, tokens.to(torch.int), {"lm loss": torch.stack([loss.detach(), tokens])}


def forward_step(data_iterator, model, stats: Optional[dict] = None):
    batch = next(data_iterator)
    chunk = unwrap(model)
    device = next(chunk.parameters()).device
    # asynchronous where the loader pins its batches; the host never waits for the device here
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True) if chunk.post_process else None
    positions = batch["position_ids"].to(device, non_blocking=True)
    output = model(tokens, positions, labels=labels, stats=stats)
    return output, partial(loss_func, batch["loss_mask"].to(device, non_blocking=True))


@dataclass
class StepResult:
    loss: float
    tokens: int
    grad_norm: Optional[float] = None
    lr: Optional[float] = None
    loss_scale: Optional[float] = None
    skipped: Optional[str] = None
    """Why the update was not applied (:data:`OVERFLOW` or the reason ``check`` gave);
    None when it was applied."""
    scale_used: Optional[float] = None
    """fp16 overflow: the loss scale the step ran with (before the scaler backed off)."""
    nonfinite: bool = False
    """Counted as a non-finite step (the trainer sets it from the health verdict)."""
    nonfinite_steps: int = 0
    """Non-finite steps so far in this process (for the log line and W&B)."""
    seconds: float = 0.0
    """Wall time of the step (data, forward, backward, optimizer), set by the trainer."""
    perf: Optional[Throughput] = None
    """On log steps (:meth:`Trainer.is_log_step`): throughput since the previous log step."""
    experts: Optional[ExpertLoad] = None
    """On log steps of a model with experts: their load and losses since the previous one."""


def _loss_totals(losses_reduced: List[dict], device) -> torch.Tensor:
    """``[token-summed loss, tokens]`` over micro-batches and DP replicas, all-reduced so
    every rank holds it, as a float64 tensor on the device (not read yet)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    contributes = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    if contributes:
        for item in losses_reduced:
            total += item["lm loss"].to(total)
    dist.all_reduce(total)
    return total


def _read(*tensors: torch.Tensor) -> list:
    """The step's one host read: every value it reports (float64), in one transfer."""
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]).tolist()


def _mean_loss(loss_sum: float, tokens: float) -> tuple:
    return loss_sum / max(tokens, 1.0), int(tokens)


def _reduce_loss(losses_reduced: List[dict], device) -> tuple:
    """Mean loss over micro-batches and DP replicas, known on every rank."""
    return _mean_loss(*_read(_loss_totals(losses_reduced, device)))


def _iterators(model, microbatches: List[Batch]):
    if len(model) == 1:
        return iter(microbatches)
    return [iter(microbatches) for _ in model]  # one per virtual stage, same data


def run_schedule(model, microbatches: List[Batch], seq_length: int, forward_only: bool,
                 force_all_reduce: bool = False, stats: Optional[dict] = None):
    """Forward (and backward) of all micro-batches through Megatron's schedule."""
    chunk = unwrap(model[0])
    geometry = chunk.geometry
    micro_batch_size = microbatches[0]["tokens"].shape[0]
    kwargs = dict(seq_length=seq_length)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:
        if len(model) > 1:  # interleaved: one P2P shape for all transitions
            kwargs["seq_length"] = geometry.schedule_seq_length()
        else:
            kwargs["adjust_tensor_shapes_fn"] = geometry.adjust_tensor_shapes_fn(
                parallel_state.get_pipeline_model_parallel_rank(), micro_batch_size
            )
    chunk.reset_depth_cache()
    step_fn = partial(forward_step, stats=stats) if stats is not None else forward_step
    losses = get_forward_backward_func()(
        forward_step_func=step_fn,
        data_iterator=_iterators(model, microbatches),
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(microbatches),
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        force_all_reduce=force_all_reduce,
        **kwargs,
    )
    chunk.reset_depth_cache()
    return losses


OVERFLOW = "fp16 overflow"


@dataclass
class Update:
    """What :func:`optimizer_step` did, with the values read for the step's result."""

    applied: bool
    loss: float
    tokens: int
    grad_norm: Optional[float]
    loss_scale: float
    """The loss scale after the step (the fp16 scaler updates it in ``prepare_grads``)."""
    skipped: Optional[str] = None
    scale_used: Optional[float] = None


def optimizer_step(optimizer, totals: torch.Tensor, check=None) -> Update:
    """Megatron's ``optimizer.step()`` (as ``ChainedOptimizer.step`` in megatron-core 0.16.1
    does it), split where the update can still be vetoed: ``prepare_grads`` (fp16: unscale,
    found-inf check, loss-scaler update), the gradient norm (all-reduced over the ranks that
    hold gradients), ``check(loss, grad_norm)``, clipping, ``step_with_ready_grads``. Megatron
    skips only fp16 overflows; in fp32/bf16 a NaN gradient would reach Adam's moments.

    ``totals``: :func:`_loss_totals` of the step. The loss, the gradient norm and the loss
    scale reach the host in one read (:func:`_read`), the only one of the step on the fused
    path (``train.fused_optimizer``: the norm computed and the clipping applied on the
    device, :mod:`depthmix.pretrain.optim`); Megatron's own norm reads the device once per
    parameter tensor on the plain path (and fp16's overflow check once more). It comes
    before the update because ``check`` may veto it.

    When not applied (``skipped`` says why), weights and optimizer state are untouched
    (fp16: the loss scaler backed off, as it should)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from depthmix.pretrain import optim

    scale_used = optimizer.get_loss_scale()  # the scaler replaces (not mutates) it on update
    if optimizer.prepare_grads():
        loss_sum, tokens, used, scale = _read(totals, scale_used, optimizer.get_loss_scale())
        return Update(False, *_mean_loss(loss_sum, tokens), None, scale, OVERFLOW, used)
    fused = optim.fused_step(optimizer)
    if fused:
        norm = optim.grad_norm(optimizer)
        loss_sum, tokens, grad_norm, scale = _read(totals, norm, optimizer.get_loss_scale())
    else:
        grad_norm = float(optimizer.get_grad_norm())
        loss_sum, tokens, scale = _read(totals, optimizer.get_loss_scale())
    loss, tokens = _mean_loss(loss_sum, tokens)
    skipped = check(loss, grad_norm) if check is not None else None
    if skipped:
        return Update(False, loss, tokens, grad_norm, scale, skipped)
    if fused:
        optim.clip_grads(optimizer, norm)
    else:
        for opt in optim.megatron_optimizers(optimizer):
            params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
            if params and opt.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(
                    params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return Update(optimizer.step_with_ready_grads(), loss, tokens, grad_norm, scale)


def train_step(model, optimizer, scheduler, microbatches: List[Batch], seq_length: int,
               force_all_reduce: bool = False, after_backward=None, check=None) -> StepResult:
    """``check(loss, grad_norm)``: None to apply the update, else the reason not to. Both
    values are already reduced over all ranks, so every rank decides alike."""
    compile_step_begin()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    overlap.force_all_reduce(model, force_all_reduce)
    losses = run_schedule(model, microbatches, seq_length, forward_only=False,
                          force_all_reduce=force_all_reduce)
    if after_backward is not None:
        after_backward(model)
    device = next(model[0].parameters()).device
    update = optimizer_step(optimizer, _loss_totals(losses, device), check)
    if update.applied:
        scheduler.step(increment=1)
    return StepResult(
        loss=update.loss,
        tokens=update.tokens,
        grad_norm=update.grad_norm,
        lr=optimizer.param_groups[0]["lr"],
        loss_scale=update.loss_scale,
        skipped=update.skipped,
        scale_used=update.scale_used,
    )


@torch.no_grad()
def eval_step(model, microbatches: List[Batch], seq_length: int) -> StepResult:
    compile_step_begin()
    for chunk in model:
        chunk.eval()
    try:
        losses = run_schedule(model, microbatches, seq_length, forward_only=True)
    finally:
        for chunk in model:
            chunk.train()
    loss, tokens = _reduce_loss(losses, next(model[0].parameters()).device)
    return StepResult(loss=loss, tokens=tokens)


def take(iterator: Iterator[Batch], n: int) -> List[Batch]:
    return [next(iterator) for _ in range(n)]
