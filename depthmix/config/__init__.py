"""Typed run configuration: Hydra structured configs, start-up validation, Megatron mapping."""

from depthmix.config.schema import (
    ConfigError,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "LoggerConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
]
