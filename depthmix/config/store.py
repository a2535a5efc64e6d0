"""Register the dataclasses with Hydra's ConfigStore as schemas the YAML files extend.

Each ``configs/<group>/<option>.yaml`` starts with ``defaults: [<group>_schema, _self_]``
(mixers: ``<mixer>_schema``), so every field exists with its type: overriding a known
field works, a misspelt one fails at composition with Hydra's message.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from depthmix.config.schema import (
    DataConfig,
    EvalConfig,
    LoggerConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)

_registered = False


def register_configs() -> None:
    global _registered
    if _registered:
        return
    from depthmix.mixers import available, get_mixer

    cs = ConfigStore.instance()
    for group, schema in (("model", ModelConfig), ("parallel", ParallelConfig),
                          ("data", DataConfig), ("train", TrainConfig),
                          ("logger", LoggerConfig), ("eval", EvalConfig)):
        cs.store(group=group, name=f"{group}_schema", node=schema)
    for name in available():
        cs.store(group="mixer", name=f"{name}_schema", node=get_mixer(name).config_cls)
    _registered = True
