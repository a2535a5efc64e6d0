"""Megatron optimizer (AdamW, optionally distributed), the LR/WD schedule, and the fused step.

``train.fused_optimizer`` (:func:`fused_enabled`) turns Megatron-Core's fallbacks without
Transformer Engine/Apex into multi-tensor work (:func:`use_fused_step`):

* the inner ``torch.optim.AdamW`` Megatron builds runs fused (one kernel over all tensors,
  ``fused=True``; ``foreach=True`` where the device has no fused kernel) instead of its
  per-tensor loop. Megatron's ``get_megatron_optimizer`` has no argument for it, so the
  flags are set on the built optimizer's parameter groups (they are what ``step`` reads),
  and kept through checkpoint loading (:func:`_keep_kernel_flags`);
* the fp32 master weights are copied into the model's 16-bit weights with one
  ``torch._foreach_copy_`` instead of a ``copy_`` per tensor (Megatron's local
  ``multi_tensor_scale`` fallback);
* the gradient norm is ``torch._foreach_norm`` and one stack, all on the device
  (:func:`grad_norm`), instead of Megatron's local ``multi_tensor_l2norm`` fallback, which
  builds a CPU tensor from one GPU scalar per parameter tensor (a host sync each); clipping
  multiplies by a coefficient that stays on the device (:func:`clip_grads`). The training
  step reads the norm once, together with the loss (:mod:`depthmix.pretrain.step`).

These act on the optimizer object (nothing process-global changes), so one process can hold
a fused and a plain optimizer side by side. The fp16 loss scaler's unscale is already one
multi-tensor op in Megatron (``torch._amp_foreach_non_finite_check_and_unscale_``), followed
by its own read of the overflow flag.
"""

from __future__ import annotations

import types
from typing import List

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from depthmix.config.schema import RunConfig
from depthmix.runtime.device import switch_on

FUSED_STEP = "depthmix_fused_step"
"""Attribute :func:`use_fused_step` sets on the optimizer; :func:`fused_step` reads it."""


def optimizer_config(run: RunConfig, config) -> OptimizerConfig:
    t = run.train
    return OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        loss_scale=None,  # dynamic loss scaling for fp16
        initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window,
        use_distributed_optimizer=run.parallel.distributed_optimizer,
        overlap_param_gather=run.parallel.overlap_param_gather,
    )


def build_optimizer(run: RunConfig, config, model):
    """AdamW without weight decay on 1-D parameters (norms) and on depth-mixing
    parameters (marked ``no_weight_decay``), and a warmup + cosine schedule in steps."""
    from megatron.core.optimizer import get_standard_config_overrides

    opt_config = optimizer_config(run, config)
    overrides = get_standard_config_overrides(opt_config)
    overrides[ParamKey(attr="no_weight_decay")] = {"wd_mult": 0.0}
    optimizer = get_megatron_optimizer(opt_config, model, config_overrides=overrides)
    if fused_enabled(run):
        use_fused_step(optimizer)
    t = run.train
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=warmup_steps(t),
        lr_decay_steps=t.steps,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def warmup_steps(t) -> int:
    return t.warmup_steps if t.warmup_steps is not None else int(t.warmup_fraction * t.steps)


# ------------------------------------------------------------------------ the fused step
def fused_enabled(run: RunConfig) -> bool:
    """``train.fused_optimizer``: ``true``, or ``auto`` on CUDA."""
    return switch_on(run.train.fused_optimizer)


def fused_step(optimizer) -> bool:
    """Whether :func:`use_fused_step` made ``optimizer`` fused."""
    return getattr(optimizer, FUSED_STEP, False)


def megatron_optimizers(optimizer) -> list:
    """The Megatron optimizers inside ``optimizer`` (a ``ChainedOptimizer``'s parts, else
    itself), stubs (no parameters on this rank) included."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _has_params(opt) -> bool:
    return not getattr(opt, "is_stub_optimizer", False) and opt.optimizer is not None


def use_fused_step(optimizer, kernel: str = "auto") -> None:
    """Make the Megatron ``optimizer`` step without per-tensor host work (module docstring).

    ``kernel``: ``fused`` (torch's fused AdamW), ``foreach`` (its multi-tensor path) or
    ``auto`` (fused where the parameters' device has the kernel, else foreach)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for opt in megatron_optimizers(optimizer):
        if not _has_params(opt):
            continue
        inner = opt.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        fused = kernel == "fused" or (kernel == "auto" and _fused_kernel_for(params))
        flags = {"fused": fused, "foreach": not fused}
        for group in inner.param_groups:
            group.update(flags)
        if fused:  # as torch.optim.AdamW(fused=True) sets it: it may take the scaler's inv scale
            inner._step_supports_amp_scaling = True
        inner.register_load_state_dict_pre_hook(_keep_kernel_flags(flags))
        inner.register_load_state_dict_post_hook(_steps_on_device)
        if isinstance(opt, DistributedOptimizer):
            opt._copy_main_params_to_model_params = types.MethodType(
                _copy_main_shards_to_param_buffer, opt)
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            opt._copy_main_params_to_model_params = types.MethodType(
                _copy_main_params_to_model_params, opt)
    setattr(optimizer, FUSED_STEP, True)


def _fused_kernel_for(params: List[torch.Tensor]) -> bool:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    supported = _get_fused_kernels_supported_devices()
    return all(p.device.type in supported and torch.is_floating_point(p) for p in params)


def _keep_kernel_flags(flags: dict):
    """Loading a state dict replaces the parameter groups with the saved ones, flags
    included: the saved groups get this run's flags first (a checkpoint of a plain run
    resumes fused, and the other way round), so torch also places each ``step`` where the
    fused kernel wants it."""

    def hook(inner, state_dict):
        state_dict = dict(state_dict)
        state_dict["param_groups"] = [{**g, **flags} for g in state_dict["param_groups"]]
        return state_dict

    return hook


def _steps_on_device(inner) -> None:
    """The fused kernel keeps each parameter's ``step`` as a float32 tensor on its device;
    a loaded state may hold a number or a CPU tensor (Megatron's common-step restore)."""
    for group in inner.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            state = inner.state.get(p)
            step = state.get("step") if state else None
            if step is not None and not (torch.is_tensor(step) and step.device == p.device):
                state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)


def _copy_main_params_to_model_params(self) -> None:
    """``Float16OptimizerWithFloat16Params``: fp32 master weights -> 16-bit model weights
    in one multi-tensor copy (the cast included; under ``no_grad``, as Megatron's step runs
    it, the parameters themselves, without a ``.data`` view each)."""
    model = [p for group in self.float16_groups for p in group]
    main = [p for group in self.fp32_from_float16_groups for p in group]
    if model:
        with torch.no_grad():
            torch._foreach_copy_(model, main)


def _copy_main_shards_to_param_buffer(self) -> None:
    """``DistributedOptimizer``: each fp32 main shard -> its range of the parameter buffer
    (which the all-gather then spreads), in one multi-tensor copy. Megatron's own method
    for what this setup does not use (Megatron-FSDP, FP8 weights, the precision-aware
    optimizer) runs unchanged."""
    from megatron.core.fp8_utils import is_float8tensor

    if self.is_stub_optimizer:
        return
    if (self.ddp_config.use_megatron_fsdp
            or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            or any(is_float8tensor(p) for g in self.model_float16_groups for p in g)):
        return type(self)._copy_main_params_to_model_params(self)
    dst, src = [], []
    for main_groups, model_groups in ((self.shard_fp32_from_float16_groups,
                                       self.model_float16_groups),
                                      (self.shard_fp32_groups, self.model_fp32_groups)):
        for main_group, model_group in zip(main_groups, model_groups):
            for main, model_param in zip(main_group, model_group):
                world = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf, _, bucket = self.model_param_gbuf_map[model_param]
                buffer = self.buffers[gbuf].buckets[bucket].param_data
                dst.append(buffer.view(-1)[world.start:world.end])
                src.append(main)
    if dst:
        torch._foreach_copy_(dst, src)


def _grad_norm_squared(grads: List[torch.Tensor], device) -> torch.Tensor:
    """Sum of squares of ``grads`` as Megatron's ``get_grad_norm_fp32`` forms it (the norm
    of the per-tensor norms, squared, fp32), with the per-tensor norms in one
    ``torch._foreach_norm`` and no host read."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) ** 2


def grad_norm(optimizer) -> torch.Tensor:
    """The global L2 norm of the gradients (each counted once: no TP duplicates, no shared
    copies; summed over the ranks that hold them), as a float64 0-d tensor on the device:
    Megatron's ``get_grad_norm`` without its host reads."""
    opts = megatron_optimizers(optimizer)
    device = _device(optimizer)

    def squared(parts) -> torch.Tensor:
        grads = [g for opt in parts for g in opt.get_main_grads_for_grad_norm()]
        total = _grad_norm_squared(grads, device)
        dist.all_reduce(total, group=parts[0].get_grad_stats_parallel_group())
        return total.double()

    if len(opts) == 1 or optimizer.grads_states_parallel_group_is_shared():
        return squared(opts).sqrt()
    return torch.stack([squared([opt]) for opt in opts]).sum().sqrt()


def clip_grads(optimizer, total_norm: torch.Tensor) -> None:
    """Scale the gradients by ``clip_grad / (total_norm + 1e-6)`` where that is below 1
    (Megatron's ``clip_grad_by_total_norm_fp32``), the coefficient computed and applied on
    the device."""
    for opt in megatron_optimizers(optimizer):
        if not _has_params(opt) or opt.config.clip_grad <= 0.0:
            continue
        grads = [p.grad for p in opt.get_parameters() if p.grad is not None]
        if not grads:
            continue
        coeff = opt.config.clip_grad / (total_norm + 1.0e-6)
        coeff = torch.where(coeff < 1.0, coeff, torch.ones_like(coeff))  # NaN: unscaled
        torch._foreach_mul_(grads, coeff.to(grads[0].dtype))


def _device(optimizer) -> torch.device:
    for opt in megatron_optimizers(optimizer):
        if _has_params(opt):
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    return p.device
    return optimizer.get_loss_scale().device
