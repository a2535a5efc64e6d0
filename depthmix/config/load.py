"""Hydra's composed ``DictConfig`` -> typed :class:`RunConfig` (and back for logging)."""

from __future__ import annotations

import dataclasses
import logging

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from depthmix.config.schema import (
    ConfigError,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from depthmix.runtime.env import launcher_rank

log = logging.getLogger("depthmix")

_GROUPS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "logger": LoggerConfig,
}


def _plain(group: str, node):
    """The group's values with interpolations resolved against the whole config (merging
    the node alone would lose ``${mixer.stride}`` in ``logger.name``)."""
    if not isinstance(node, DictConfig):
        return node
    try:
        return OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or group
        text = str(e.msg if hasattr(e, "msg") else e).strip().splitlines()[0]
        raise ConfigError(f"{key}: {text}") from None


def _typed(group: str, schema: type, node) -> object:
    node = _plain(group, node)
    known = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(node or {}) - known)
    if unknown:
        raise ConfigError(f"{group}: unknown option(s) {', '.join(f'{group}.{k}' for k in unknown)}"
                          f"; known: {', '.join(sorted(known))}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node or {})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None) or ""
        raise ConfigError(f"{group}: {key}: {e.msg if hasattr(e, 'msg') else e}") from None


def resolve(cfg: DictConfig) -> RunConfig:
    """Type-check every group against its dataclass and fill preset-dependent defaults."""
    from depthmix.mixers import get_mixer

    groups = {name: _typed(name, schema, cfg.get(name)) for name, schema in _GROUPS.items()}
    mixer_node = cfg.get("mixer") or {"name": "vanilla"}
    mixer = get_mixer(mixer_node.get("name", "vanilla"))
    mixer_cfg = _typed("mixer", mixer.config_cls, mixer_node)
    mixer_cfg.resolve(groups["model"])
    from depthmix.kernels.dispatch import resolve_impl

    requested = mixer_cfg.impl
    mixer_cfg.impl, reason = resolve_impl(requested)
    if requested != mixer_cfg.impl or requested == "auto":
        log.debug("mixer.impl=%s -> %s (%s)", requested, mixer_cfg.impl, reason)
    name = (cfg.get("run") or {}).get("name")
    run = RunConfig(mixer=mixer_cfg, output_dir=cfg.get("output_dir", "."),
                    name=None if name is None else str(name), **groups)
    resolve_experts_impl(run)
    return run


def resolve_experts_impl(run: RunConfig) -> None:
    """``model.moe.experts_impl``: ``auto`` becomes ``grouped`` on CUDA (where the experts'
    rows are aligned as ``torch._grouped_mm`` needs), else ``sequential``; ``grouped``
    is refused where this torch has no ``torch._grouped_mm`` for the device. Logged, once,
    where it is resolved (a resolved value is left as it is). Nothing for a dense model."""
    from depthmix.config.validate import check_choice, grouped_experts_misaligned

    e = run.model.experts
    if e is None:
        return
    requested = e.experts_impl
    check_choice("model.moe.experts_impl", requested, ("auto", "sequential", "grouped"))
    if requested == "sequential":
        return
    usable, device = _grouped_mm_status()
    if requested == "grouped":
        if not usable:
            raise ConfigError(f"model.moe.experts_impl=grouped cannot run here: {device}")
        return
    misaligned = grouped_experts_misaligned(run)
    if not usable or device == "cpu" or misaligned:
        e.experts_impl = "sequential"
        reason = (device if not usable else "no CUDA device" if device == "cpu"
                  else misaligned)
    else:
        e.experts_impl = "grouped"
        kernel = ("its CUTLASS kernel on sm90/sm100" if run.train.precision == "bf16" else
                  f"a loop of GEMMs for train.precision={run.train.precision} (its fused "
                  "kernel takes bf16 on sm90/sm100)")
        reason = f"CUDA: torch._grouped_mm, {kernel}"
    if launcher_rank() == 0:  # every rank resolves it alike; the console says it once
        log.info("model.moe.experts_impl=auto -> %s (%s)", e.experts_impl, reason)


def _grouped_mm_status():
    """``(True, "cuda" | "cpu")`` where ``torch._grouped_mm`` runs (the CPU kernel came with
    torch 2.9), else ``(False, why)``."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm (2.8+ has it)"
    if torch.cuda.is_available():
        return True, "cuda"
    try:
        torch._grouped_mm(torch.zeros(2, 4), torch.zeros(2, 4, 4),
                          offs=torch.tensor([1, 2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as e:
        return False, (f"torch {torch.__version__}'s torch._grouped_mm has no CPU kernel "
                       f"({str(e).splitlines()[0][:120]}; torch 2.9+ has one)")
    return True, "cpu"


def saved_mixer(options: dict, model: ModelConfig, **overrides):
    """The typed mixer config of ``options`` as a checkpoint record saved them: the config
    class of the mixer ``options["name"]``, the options that class still has, then
    ``overrides`` (e.g. ``impl="torch"``), resolved against ``model`` and its ``impl``
    resolved, as :func:`resolve` does."""
    from depthmix.kernels.dispatch import resolve_impl
    from depthmix.mixers import get_mixer

    config_cls = get_mixer(options["name"]).config_cls
    fields = {f.name for f in dataclasses.fields(config_cls)}
    kept = {k: v for k, v in options.items() if k in fields}
    kept.update(overrides)
    mixer = config_cls(**kept)
    mixer.resolve(model)
    mixer.impl, _ = resolve_impl(mixer.impl)
    return mixer


def compose_run(*overrides: str, config_name: str = "config") -> RunConfig:
    """Compose ``depthmix/configs`` with command-line style overrides (tests, tools)."""
    from hydra import compose, initialize_config_module

    from depthmix.config.store import register_configs

    register_configs()
    with initialize_config_module("depthmix.configs", version_base=None):
        cfg = compose(config_name, overrides=["output_dir=.", *overrides])
    return resolve(cfg)


def to_container(run: RunConfig) -> dict:
    """Plain dict of the resolved config (for W&B and checkpoints)."""
    return dataclasses.asdict(run)
