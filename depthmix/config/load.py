"""Hydra's composed ``DictConfig`` -> typed :class:`RunConfig` (and back for logging)."""

from __future__ import annotations

import dataclasses

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

_GROUPS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "logger": LoggerConfig,
}


def _typed(group: str, schema: type, node) -> object:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node or {})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None) or ""
        raise ConfigError(f"{group}: {key}: {e.msg if hasattr(e, 'msg') else e}") from None


def resolve(cfg: DictConfig) -> RunConfig:
    """Type-check every group against its dataclass and fill preset-dependent defaults."""
    from depthmix.megatron_ext.mixers import get_mixer

    groups = {name: _typed(name, schema, cfg.get(name)) for name, schema in _GROUPS.items()}
    mixer_node = cfg.get("mixer") or {"name": "vanilla"}
    mixer = get_mixer(mixer_node.get("name", "vanilla"))
    mixer_cfg = _typed("mixer", mixer.config_cls, mixer_node)
    mixer_cfg.resolve(groups["model"])
    return RunConfig(mixer=mixer_cfg, output_dir=cfg.get("output_dir", "."), **groups)


def to_container(run: RunConfig) -> dict:
    """Plain dict of the resolved config (for W&B and checkpoints)."""
    return dataclasses.asdict(run)
