"""A decoder layer whose residual connections and depth reads are pluggable submodules.

The forward reads like the block equation. With the default submodules it is the
pre-norm Qwen3 layer ``h = h + attn(norm(h)); h = h + mlp(norm(h))``; a depth mixer
replaces some slots:

* ``attn_residual`` / ``mlp_residual`` (:class:`ResidualOp`): how a sublayer's input is
  read from the depth state and how its output is written back (AttnRes, mHC, DDL); the
  layer asks for the input through its norm (``read_normed``), which a mixer's kernel may
  apply in the same pass;
* ``self_attention.depth_mixer``: depth reads inside attention (Depth-Attention, MoDA);
* ``mlp_depth_kv``: a depth entry made from the MLP input (MoDA's FFN KV projection);
* ``short_swa``: a sequence-axis sublayer folded into the attention sublayer (ShortSWA):
  ``s = swa(x)``, ``y = s + attn(norm(x + s))``; with the plain residual this is seed
  004's ``S = H + ShortSWA(Norm(H))`` before attention, and it composes with any
  residual operator;
* ``post_layer``: an operation on the state after the layer (DenseFormer's DWA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple, Union

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from depthmix.megatron_ext.context import ForwardContext
from depthmix.planning.depth_plan import HIDDEN, DepthState


class ResidualOp(MegatronModule):
    """Plain residual connection around one sublayer: read ``h``, write ``h + y``.

    ``read`` returns the sublayer input and a token handed back to ``write`` (methods
    whose write depends on quantities computed at read time, e.g. mHC, use it).
    With ``post_norm`` the write is ``h = norm(h + y)`` (post-norm blocks).
    """

    def __init__(self, config, layer_number: int = 1, sublayer: str = "attn",
                 post_norm: Union[ModuleSpec, type, None] = None, **kwargs):
        super().__init__(config=config)
        self.sublayer = sublayer
        self.post_norm = (
            build_module(post_norm, config=config, hidden_size=config.hidden_size,
                         eps=config.layernorm_epsilon)
            if post_norm is not None
            else None
        )

    def read(self, state: DepthState, ctx: ForwardContext) -> Tuple[Tensor, Any]:
        return state[HIDDEN], None

    def read_normed(self, state: DepthState, ctx: ForwardContext,
                    norm: MegatronModule) -> Tuple[Tensor, Any]:
        """``norm`` of the sublayer input, and the token for ``write``. Here ``norm(read)``;
        a mixer whose kernel aggregates the input can apply a plain RMSNorm in the same
        pass (``impl=triton``), so the un-normed input never goes to memory."""
        x, token = self.read(state, ctx)
        return norm(x), token

    def write(self, state: DepthState, output: Tensor, token: Any, ctx: ForwardContext) -> None:
        hidden = state[HIDDEN] + output
        state[HIDDEN] = self.post_norm(hidden) if self.post_norm is not None else hidden


class StateHook(MegatronModule):
    """A no-op slot; subclasses act on the depth state at a fixed point of the layer."""

    def __init__(self, config, layer_number: int = 1, **kwargs):
        super().__init__(config=config)

    def forward(self, state: DepthState, ctx: ForwardContext, *args) -> None:
        return None


class NoShortSWA(MegatronModule):
    """ShortSWA off: contributes nothing to the attention sublayer."""

    def __init__(self, config, layer_number: int = 1, **kwargs):
        super().__init__(config=config)

    def forward(self, x: Tensor, ctx: ForwardContext):
        return None


@dataclass
class DepthMixLayerSubmodules:
    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp
    attn_residual: Union[ModuleSpec, type] = ResidualOp
    mlp_residual: Union[ModuleSpec, type] = ResidualOp
    short_swa: Union[ModuleSpec, type] = NoShortSWA
    mlp_depth_kv: Union[ModuleSpec, type] = StateHook
    post_layer: Union[ModuleSpec, type] = StateHook


class DepthMixLayer(MegatronModule):
    """One transformer layer acting on a depth state (see module docstring)."""

    def __init__(self, config, submodules: DepthMixLayerSubmodules, layer_number: int = 1,
                 pg_collection=None):
        super().__init__(config=config)
        self.layer_number = layer_number  # 1-based global index of the unique layer
        self.submodules_config = submodules
        h, eps = config.hidden_size, config.layernorm_epsilon

        # 1: attention sublayer (with optional ShortSWA) and its residual connection
        self.attn_residual = build_module(submodules.attn_residual, config=config,
                                          layer_number=layer_number, sublayer="attn")
        self.short_swa = build_module(submodules.short_swa, config=config,
                                      layer_number=layer_number)
        self.input_layernorm = build_module(submodules.input_layernorm, config=config,
                                            hidden_size=h, eps=eps)
        self.self_attention = build_module(submodules.self_attention, config=config,
                                           layer_number=layer_number, pg_collection=pg_collection)
        # 2: MLP sublayer with its residual connection (and optional depth-KV projection)
        self.mlp_residual = build_module(submodules.mlp_residual, config=config,
                                         layer_number=layer_number, sublayer="mlp")
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config=config,
                                              hidden_size=h, eps=eps)
        self.mlp = build_module(submodules.mlp, config=config,
                                **_mlp_kwargs(submodules.mlp, pg_collection))
        if hasattr(self.mlp, "set_layer_number"):  # MoE: its router logs under the number
            self.mlp.set_layer_number(layer_number)
        self.mlp_depth_kv = build_module(submodules.mlp_depth_kv, config=config,
                                         layer_number=layer_number)
        # 3: after-layer operation on the whole state (DenseFormer), a no-op by default
        self.post_layer = build_module(submodules.post_layer, config=config,
                                       layer_number=layer_number)

    def forward(self, state: DepthState, ctx: ForwardContext) -> DepthState:
        if not isinstance(self.short_swa, NoShortSWA):  # the norm reads x + swa
            x, token = self.attn_residual.read(state, ctx)
            swa = self.short_swa(x, ctx)
            y = self.self_attention(self.input_layernorm(x + swa), state, ctx) + swa
        else:
            x, token = self.attn_residual.read_normed(state, ctx, self.input_layernorm)
            y = self.self_attention(x, state, ctx)
        self.attn_residual.write(state, y, token, ctx)

        x, token = self.mlp_residual.read_normed(state, ctx, self.pre_mlp_layernorm)
        self.mlp_depth_kv(state, ctx, x)
        y, bias = self.mlp(x)
        assert bias is None, "depthmix layers are bias-free"
        self.mlp_residual.write(state, y, token, ctx)

        self.post_layer(state, ctx)
        return state


def _mlp_kwargs(spec, pg_collection) -> dict:
    """An MoE sublayer (Megatron's ``MoELayer``) takes its process groups (None: Megatron's
    parallel state); a dense MLP does not."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if isinstance(module, type) and issubclass(module, BaseMoELayer):
        return {"pg_collection": pg_collection}
    return {}


def mark_mixing_parameter(param, config) -> None:
    """Per-token parameters on the full hidden: grads are partial per sequence shard under
    sequence parallelism (all-reduced over TP), and they are excluded from weight decay."""
    param.sequence_parallel = config.sequence_parallel
    param.no_weight_decay = True
