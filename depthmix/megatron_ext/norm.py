"""RMSNorm that works under sequence parallelism (Megatron's torch fallback refuses SP)."""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule


class RMSNorm(MegatronModule):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32 (fp64 inputs: in fp64).

    Acting on a sequence-parallel shard, the weight's gradient differs per TP rank;
    ``weight.sequence_parallel`` tells Megatron's grad finalisation to all-reduce it.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, sequence_parallel=None):
        super().__init__(config=config)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if sequence_parallel is None:
            sequence_parallel = config.sequence_parallel
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 for 16-bit, fp64 stays
        x32 = x.to(dtype)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(dtype)).to(x.dtype)


class QKNorm(RMSNorm):
    """Per-head RMSNorm of queries/keys (Qwen3). Runs on full-sequence local heads, so no
    SP flag; Megatron all-reduces ``q_layernorm``/``k_layernorm`` grads over TP by name."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__(config, hidden_size, eps, sequence_parallel=False)


def is_plain_rmsnorm(norm) -> bool:
    """Whether ``norm`` is exactly :class:`RMSNorm` (a subclass or another norm may do other
    math): a kernel can then apply it from its weight and epsilon, ``x * rsqrt(mean(x^2) +
    eps) * weight`` in fp32, the weight's gradient summed over the rank's tokens as here."""
    return type(norm) is RMSNorm
