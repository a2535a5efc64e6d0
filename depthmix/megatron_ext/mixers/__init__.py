"""Registry of depth mixers: ``mixer=<name>`` selects ``depthmix.megatron_ext.mixers.<name>``.

Each module defines ``MIXER`` (a :class:`~depthmix.megatron_ext.mixers.base.Mixer`), or
``MIXERS`` (name -> Mixer) when one module holds several variants.
"""

from __future__ import annotations

import importlib

from depthmix.config.schema import ConfigError
from depthmix.megatron_ext.mixers.base import ExtraParams, Mixer, MixerConfig

MIXER_MODULES = {
    "vanilla": "vanilla",
    "depth_attn": "depth_attn",
    "mhc": "mhc",
    "ddl": "ddl",
    "attnres_full": "attnres",
    "attnres_block": "attnres",
    "denseformer": "denseformer",
    "moda": "moda",
}


def available() -> list:
    return sorted(MIXER_MODULES)


def get_mixer(name: str) -> Mixer:
    if name not in MIXER_MODULES:
        raise ConfigError(f"mixer={name!r} is unknown; choose one of {available()}")
    module = importlib.import_module(f"depthmix.megatron_ext.mixers.{MIXER_MODULES[name]}")
    return module.MIXERS[name] if hasattr(module, "MIXERS") else module.MIXER


__all__ = ["ExtraParams", "Mixer", "MixerConfig", "available", "get_mixer"]
