"""``mixer=vanilla``: the plain residual decoder every method is compared against."""

from depthmix.mixers.base import Mixer, MixerConfig, model_spec_in, residual_plan

MIXER = Mixer(name="vanilla", config_cls=MixerConfig,
              model_spec=model_spec_in("vanilla", "get_vanilla_model_spec"), plan=residual_plan)
