"""Deep Delta Learning (Zhang, Liu, Wang, Gu 2026, arXiv:2601.00417) as a residual operator.

The Residual Stream Duality paper recommends DDL "when the shortcut is the object": instead of ``X
+ F(x)``, each
sublayer applies the delta rule to a matrix state ``X in R^{d x d_v}`` per token
(depth-state entry ``"ddl"``, ``[s, b, h, d_v]`` on the sequence-parallel shard)::

    x_in = X r                                   read vector r (init 1/d_v)
    k    = F(norm(x_in)) / ||F(norm(x_in))||     direction: RMS-normalised / sqrt(d)
    beta = 2 sigmoid(w_beta . rmsnorm(x_in) + b_beta)   gate in (0, 2), fp32
    v    = v_scale * sigmoid(W_v x_in + b_v)     values in R^{d_v}
    X   <- X + beta k (v^T - k^T X)  =  (I - beta k k^T) X + beta k v^T

The Delta operator ``I - beta k k^T`` has eigenvalues ``{1, ..., 1, 1 - beta}``: identity
(beta -> 0), projection (beta = 1), reflection (beta -> 2). The embedding is replicated
into the ``d_v`` columns (``DeltaStem``); the final norm reads ``X r_out`` with its own read
vector (``DeltaReadout``). Choices follow the authors' reference code (``model/DDL.py``,
expanded state); see ``docs/methods/ddl.md`` for what we follow and what we leave out.
The read and the update are :mod:`depthmix.kernels.ddl`'s ops (``mixer.impl``: the PyTorch
reference or the fused Triton kernels).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from depthmix.kernels.dispatch import select
from depthmix.mixers.ddl import STATE
from depthmix.megatron_ext.layer import ResidualOp
from depthmix.megatron_ext.layer import mark_mixing_parameter
from depthmix.megatron_ext.model import seeded_init
from depthmix.megatron_ext.specs import get_decoder_layer_submodules, get_model_submodules

_SUBLAYER_SEED = {"attn": 505, "mlp": 606}


class DeltaResidual(ResidualOp):
    """The ``attn_residual`` / ``mlp_residual`` slot: read ``X r``, write the delta update.
    The token handed from read to write is ``x_in`` (``v`` and ``beta`` read it)."""

    def __init__(self, config, layer_number: int = 1, sublayer: str = "attn", **kwargs):
        super().__init__(config, layer_number=layer_number, sublayer=sublayer)
        mc = config.mixer
        h, dv = config.hidden_size, mc.value_channels
        self.v_scale, self.eps = mc.v_scale, config.layernorm_epsilon
        dtype = config.params_dtype
        with seeded_init(config.init_seed + 1000 * layer_number + _SUBLAYER_SEED[sublayer]):
            beta_weight = torch.randn(h) * config.init_method_std
            v_weight = torch.randn(dv, h) * config.init_method_std
        p = mc.beta_init / 2.0
        self.read_vector = torch.nn.Parameter(torch.full((dv,), 1.0 / dv, dtype=dtype))
        self.beta_weight = torch.nn.Parameter(beta_weight.to(dtype))
        self.beta_bias = torch.nn.Parameter(torch.full((1,), math.log(p / (1 - p)), dtype=dtype))
        self.v_weight = torch.nn.Parameter(v_weight.to(dtype))
        self.v_bias = torch.nn.Parameter(torch.zeros(dv, dtype=dtype))
        for param in self.parameters():
            mark_mixing_parameter(param, config)
        self._read_op, self._write_op = select("ddl", mc.impl)

    def read(self, state, ctx):
        x_in = self._read_op(state[STATE], self.read_vector)  # [s, b, h]
        return x_in, x_in

    def write(self, state, output, token, ctx) -> None:
        new, beta = self._write_op(state[STATE], output, token, self.beta_weight,
                                   self.beta_bias, self.v_weight, self.v_bias, self.v_scale,
                                   self.eps, ctx.stats is not None)
        if ctx.stats is not None:
            ctx.record(f"{self.sublayer}/beta", beta.detach().mean())
        state[STATE] = new


class DeltaStem(MegatronModule):
    """Embedding ``[s, b, h]`` replicated into the ``d_v`` columns: ``[s, b, h, d_v]``."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config)
        self.value_channels = config.mixer.value_channels

    def forward(self, embeddings):
        s, b, h = embeddings.shape
        return {STATE: embeddings.unsqueeze(-1).expand(s, b, h, self.value_channels).contiguous()}


class DeltaReadout(MegatronModule):
    """Final state -> the final norm's input ``X r_out`` (own read vector, init 1/d_v)."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config)
        dv = config.mixer.value_channels
        self.read_vector = torch.nn.Parameter(torch.full((dv,), 1.0 / dv,
                                                         dtype=config.params_dtype))
        mark_mixing_parameter(self.read_vector, config)
        self._read_op = select("ddl", config.mixer.impl).read

    def forward(self, state, ctx):
        return self._read_op(state[STATE], self.read_vector)


def get_ddl_model_spec(config):
    residual = ModuleSpec(module=DeltaResidual)
    layer = dataclasses.replace(get_decoder_layer_submodules(config),
                                attn_residual=residual, mlp_residual=residual)
    return get_model_submodules(config, layer, stem=DeltaStem, head=DeltaReadout)
