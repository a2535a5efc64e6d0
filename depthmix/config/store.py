"""Register the dataclasses with Hydra's ConfigStore as schemas the YAML files extend.

Each ``configs/<group>/<option>.yaml`` starts with ``defaults: [<group>_schema, _self_]``
(mixers: ``<mixer>_schema``), so every field exists with its type: overriding a known
field works, a misspelt one fails at composition with Hydra's message. A mixer without a
YAML file (one from the search path, see :mod:`depthmix.mixers`) gets its ``mixer=<name>``
choice from its config class.
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
    from depthmix.mixers import available, get_mixer, has_yaml

    cs = ConfigStore.instance()
    if not _registered:
        for group, schema in (("model", ModelConfig), ("parallel", ParallelConfig),
                              ("data", DataConfig), ("train", TrainConfig),
                              ("logger", LoggerConfig), ("eval", EvalConfig)):
            cs.store(group=group, name=f"{group}_schema", node=schema)
        _registered = True
    for name in available():  # every call: a mixer folder may have joined the search path
        config_cls = get_mixer(name).config_cls
        cs.store(group="mixer", name=f"{name}_schema", node=config_cls)
        if not has_yaml(name):  # its mixer=<name> choice: the config class's defaults
            cs.store(group="mixer", name=name, node=config_cls(name=name))
