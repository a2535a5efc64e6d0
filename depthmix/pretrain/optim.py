"""Megatron optimizer (AdamW, optionally distributed) and the LR/WD schedule."""

from __future__ import annotations

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from depthmix.config.schema import RunConfig


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
