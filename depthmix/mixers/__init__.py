"""Registry of depth mixers: ``mixer=<name>`` selects ``depthmix.mixers.<module>``.

Each module defines the method's options (a :class:`MixerConfig` subclass), its depth
plan and cost hooks, and ``MIXER`` (a :class:`Mixer`), or ``MIXERS`` (name -> Mixer) when
one module holds several variants. None of it imports Megatron: the model code is in
``depthmix.mixers.<module>``, imported when a model is built.
"""

from __future__ import annotations

import importlib

from depthmix.mixers.base import ExtraParams, Mixer, MixerConfig
from depthmix.config.validate import closest

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
    from depthmix.config.schema import ConfigError

    if name not in MIXER_MODULES:
        raise ConfigError(f"mixer={name!r} is unknown; choose one of {available()}"
                          f"{closest(name, available())}")
    module = importlib.import_module(f"depthmix.mixers.{MIXER_MODULES[name]}")
    return module.MIXERS[name] if hasattr(module, "MIXERS") else module.MIXER


__all__ = ["ExtraParams", "Mixer", "MixerConfig", "available", "get_mixer"]
