"""Vanilla: the plain residual decoder every method is compared against."""

from depthmix.megatron_ext.specs import get_decoder_layer_submodules, get_model_submodules


def get_vanilla_model_spec(config):
    return get_model_submodules(config, get_decoder_layer_submodules(config))
