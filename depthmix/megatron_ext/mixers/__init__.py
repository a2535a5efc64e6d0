"""Model code of the depth mixers: ``depthmix.megatron_ext.mixers.<module>`` holds a method's
Megatron modules and its ``get_<method>_model_spec``. Options, plans and cost hooks live in
:mod:`depthmix.config.mixers` (importable without Megatron), whose registry is re-exported here.
"""

from __future__ import annotations

from depthmix.config.mixers import MIXER_MODULES, available, get_mixer
from depthmix.config.mixers.base import ExtraParams, Mixer, MixerConfig

__all__ = ["MIXER_MODULES", "ExtraParams", "Mixer", "MixerConfig", "available", "get_mixer"]
