"""Hyper-Connections (Zhu et al. 2025) and mHC, manifold-constrained HC (Xie et al. 2025).

The residual stream is widened to ``n`` streams, ``X [n, h]`` per token (depth-state
entry ``"streams"``, ``[s, b, n, h]`` on the sequence-parallel shard). Around every
sublayer ``F`` (attention and MLP separately)::

    X <- H_res X + H_post^T F(H_pre X)

with per-token coefficients from ``RMSNorm(flatten X)`` through a small projection scaled
by learnable gates, plus static biases (``depthmix.kernels.mhc``):

* ``variant=mhc``: ``H_pre = sigmoid``, ``H_post = 2 sigmoid``, ``H_res`` = Sinkhorn-Knopp
  projection onto the doubly stochastic matrices (fp32, ``sinkhorn_iters`` iterations);
* ``variant=hc``: unconstrained ``H = b + alpha tanh(.)`` (the original Hyper-Connections);
* ``variant=identity``: ``hc`` with ``H_res = I``.

Initialisation starts as a plain residual network: mHC follows its paper's appendix
(``b_pre = -3`` with ``+3`` on the home stream, ``b_post = 0``, ``b_res = 6 I - 3``, gates
0.01); HC follows Zhu et al. eq. 14 (``b_pre`` one-hot on the home stream, ``b_post = 1``,
``b_res = I``). The home stream of sublayer ``k`` (attention ``2l``, MLP ``2l + 1``) is
``k mod n``. The embedding is copied into the ``n`` streams (``StreamStem``); the final
norm reads their mean (``StreamHead``). See ``docs/methods/mhc.md``.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from depthmix.mixers.mhc import STREAMS, coefficient_width
from depthmix.kernels.dispatch import select
from depthmix.kernels.mhc import mhc_coefficients
from depthmix.megatron_ext.layer import ResidualOp
from depthmix.megatron_ext.layer import mark_mixing_parameter
from depthmix.megatron_ext.model import seeded_init
from depthmix.megatron_ext.norm import is_plain_rmsnorm
from depthmix.megatron_ext.specs import get_decoder_layer_submodules, get_model_submodules



def static_bias(variant: str, n: int, home: int) -> torch.Tensor:
    """Static biases ``[m]`` (pre | post | res) that make the sublayer a plain residual."""
    pre = torch.zeros(n)
    if variant == "mhc":  # Xie et al. 2025, appendix: sigmoid(+-3), 2 sigmoid(0) = 1, 6I - 3
        pre.fill_(-3.0)
        pre[home] = 3.0
        post = torch.zeros(n)
        res = 6.0 * torch.eye(n) - 3.0
    else:  # Zhu et al. 2025, eq. 14: A_m = e_home, B = 1, A_r = I
        pre[home] = 1.0
        post = torch.ones(n)
        res = torch.eye(n)
    parts = [pre, post] if variant == "identity" else [pre, post, res.flatten()]
    return torch.cat(parts)


_SUBLAYER_SEED = {"attn": 101, "mlp": 202}


class HyperConnection(ResidualOp):
    """The ``attn_residual`` / ``mlp_residual`` slot: reads ``H_pre X``, writes
    ``H_res X + H_post^T y``. The token handed from read to write is ``(H_post, H_res)``."""

    def __init__(self, config, layer_number: int = 1, sublayer: str = "attn", **kwargs):
        super().__init__(config, layer_number=layer_number, sublayer=sublayer)
        mc = config.mixer
        n, h = mc.streams, config.hidden_size
        self.variant, self.streams, self.sinkhorn_iters = mc.variant, n, mc.sinkhorn_iters
        self.eps = config.layernorm_epsilon
        sublayer_index = 2 * (layer_number - 1) + (sublayer == "mlp")
        self.home = sublayer_index % n
        m = coefficient_width(self.variant, n)
        dtype = config.params_dtype
        # Own seed: the rest of the layer draws the same weights as vanilla from one seed.
        with seeded_init(config.init_seed + 1000 * layer_number + _SUBLAYER_SEED[sublayer]):
            phi = torch.randn(n * h, m) * config.init_method_std
        self.phi = torch.nn.Parameter(phi.to(dtype))
        gates = 2 if self.variant == "identity" else 3
        self.alpha = torch.nn.Parameter(torch.full((gates,), mc.gate_init, dtype=dtype))
        self.bias = torch.nn.Parameter(static_bias(self.variant, n, self.home).to(dtype))
        for param in (self.phi, self.alpha, self.bias):
            mark_mixing_parameter(param, config)
        # The ops, chosen once from mixer.impl: the reference (PyTorch) or the fused Triton
        # kernels (two launches per sublayer: read, post/res), same signatures. The Triton
        # read also applies the sublayer's input RMSNorm (read_normed).
        self._read_op, self._post_res_op = select("mhc", mc.impl)
        self._fuses_norm = mc.impl == "triton"

    def coefficients(self, x):
        return mhc_coefficients(x, self.phi, self.alpha, self.bias, self.variant,
                                self.sinkhorn_iters, self.eps)

    def read(self, state, ctx):
        return self._read(state, ctx)

    def read_normed(self, state, ctx, norm):
        if self._fuses_norm and is_plain_rmsnorm(norm):
            return self._read(state, ctx, norm.weight, norm.eps)
        return super().read_normed(state, ctx, norm)

    def _read(self, state, ctx, *norm):
        """``H_pre X`` (through the RMSNorm of ``norm = (weight, eps)``) and the token."""
        x = state[STREAMS]  # [s, b, n, h]
        x_in, h_pre, h_post, h_res = self._read_op(x, self.phi, self.alpha, self.bias,
                                                   self.variant, self.sinkhorn_iters, self.eps,
                                                   *norm)
        if ctx.stats is not None:
            with torch.no_grad():
                ctx.record(f"{self.sublayer}/H_pre", h_pre.mean(dim=(0, 1)))
                ctx.record(f"{self.sublayer}/H_post", h_post.mean(dim=(0, 1)))
                eye = torch.eye(self.streams, dtype=h_pre.dtype, device=h_pre.device)
                ctx.record(f"{self.sublayer}/H_res",
                           eye if h_res is None else h_res.mean(dim=(0, 1)))
        return x_in, (h_post, h_res)  # x_in [s, b, h]

    def write(self, state, output, token, ctx) -> None:
        h_post, h_res = token
        x = state[STREAMS]
        state[STREAMS] = self._post_res_op(x, output, h_post, h_res).to(x.dtype)


class StreamStem(MegatronModule):
    """Embedding ``[s, b, h]`` -> ``n`` identical streams ``[s, b, n, h]``."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config)
        self.streams = config.mixer.streams

    def forward(self, embeddings):
        s, b, h = embeddings.shape
        return {STREAMS: embeddings.unsqueeze(2).expand(s, b, self.streams, h).contiguous()}


class StreamHead(MegatronModule):
    """Streams -> the final norm's input: their mean (exactly the residual stream when the
    streams are equal, as at initialisation)."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config)

    def forward(self, state, ctx):
        return state[STREAMS].mean(dim=2)


def get_mhc_model_spec(config):
    residual = ModuleSpec(module=HyperConnection)
    layer = dataclasses.replace(get_decoder_layer_submodules(config),
                                attn_residual=residual, mlp_residual=residual)
    return get_model_submodules(config, layer, stem=StreamStem, head=StreamHead)
