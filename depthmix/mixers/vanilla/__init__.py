"""``mixer=vanilla``: the plain residual decoder every method is compared against."""

from depthmix.mixers.base import Mixer, MixerConfig, Variant, model_hook, residual_plan

MIXER = Mixer(
    name="vanilla", config_cls=MixerConfig, plan=residual_plan,
    model_spec=model_hook(__name__, "get_vanilla_model_spec"),
    variants=(
        Variant(checks=("decode", "transport", "accounting", "generate", "parity")),
        Variant("swa3", {"short_swa_window": 3}, checks=("decode", "recompute", "generate")),
        Variant("swa4", {"short_swa_window": 4}, checks=("accounting", "parity")),
    ))
