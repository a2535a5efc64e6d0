"""Layer and model specs (Megatron ``ModuleSpec`` idiom).

``get_decoder_layer_submodules(config)`` is the vanilla Qwen3 layer; every mixer starts
from it and swaps the slots it needs with ``dataclasses.replace``. ``get_model_submodules``
wraps the mixer's layer; with experts (``model.moe``) it gives one layer spec per layer,
the MoE layers' MLP slot holding Megatron's MoE layer (:mod:`depthmix.megatron_ext.moe`).
"""

from __future__ import annotations

import dataclasses

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from depthmix.megatron_ext.attention import (
    DepthMixAttentionSubmodules,
    DepthMixSelfAttention,
    SDPACoreAttention,
)
from depthmix.megatron_ext.layer import DepthMixLayer, DepthMixLayerSubmodules, ResidualOp
from depthmix.megatron_ext.model import DepthMixModelSubmodules
from depthmix.megatron_ext.norm import QKNorm, RMSNorm


def get_attention_spec(config, depth_mixer=None, core_attention=SDPACoreAttention) -> ModuleSpec:
    submodules = DepthMixAttentionSubmodules(
        linear_qkv=ColumnParallelLinear,
        core_attention=core_attention,
        linear_proj=RowParallelLinear,
        q_layernorm=QKNorm if config.qk_layernorm else None,
        k_layernorm=QKNorm if config.qk_layernorm else None,
    )
    if depth_mixer is not None:
        submodules.depth_mixer = depth_mixer
    return ModuleSpec(module=DepthMixSelfAttention, submodules=submodules)


def get_decoder_layer_submodules(config) -> DepthMixLayerSubmodules:
    """The vanilla layer: pre-norm (or post-norm) attention and SwiGLU MLP, plus the
    sequence-axis ShortSWA sublayer when ``mixer.short_swa_window > 0``."""
    post = config.norm_position == "post"
    residual = ModuleSpec(module=ResidualOp, params={"post_norm": RMSNorm if post else None})
    layer = DepthMixLayerSubmodules(
        input_layernorm=IdentityOp if post else RMSNorm,
        self_attention=get_attention_spec(config),
        pre_mlp_layernorm=IdentityOp if post else RMSNorm,
        mlp=ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                     linear_fc2=RowParallelLinear),
        ),
        attn_residual=residual,
        mlp_residual=residual,
    )
    # the Residual Stream Duality paper's ShortSWA, any mixer
    if getattr(config.mixer, "short_swa_window", 0) > 0:
        from depthmix.megatron_ext.short_swa import get_short_swa_spec

        layer.short_swa = get_short_swa_spec(config)
    return layer


def get_layer_specs(config, layer: DepthMixLayerSubmodules):
    """The ``DepthMixLayer`` spec of every layer: one spec, or with experts a tuple of one
    per (unique) layer, the MoE layers' MLP slot holding the MoE spec."""
    dense = ModuleSpec(module=DepthMixLayer, submodules=layer)
    if not config.num_moe_experts:
        return dense
    from depthmix.megatron_ext.moe import get_moe_spec

    moe = ModuleSpec(module=DepthMixLayer,
                     submodules=dataclasses.replace(layer, mlp=get_moe_spec(config)))
    return tuple(moe if is_moe else dense for is_moe in config.moe_layer_freq)


def get_model_submodules(config, layer: DepthMixLayerSubmodules, **overrides):
    """Model spec around a layer spec; ``overrides`` replace the stem/head/final norm."""
    spec = DepthMixModelSubmodules(
        layer=get_layer_specs(config, layer),
        final_layernorm=RMSNorm,
    )
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec
