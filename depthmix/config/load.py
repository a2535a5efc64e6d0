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
    return RunConfig(mixer=mixer_cfg, output_dir=cfg.get("output_dir", "."),
                     name=None if name is None else str(name), **groups)


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
