"""Grouped-GEMM experts: Megatron's ``SequentialMLP`` with every expert's GEMM in one call.

``SequentialMLP`` (the reference, and the path on the CPU) runs the local experts' SwiGLU
MLPs one after the other: a split of the tokens, two GEMMs and the activation per expert,
each launched from Python. :class:`GroupedExperts` *is* a ``SequentialMLP`` -- the same
constructor, the same parameters (``local_experts.<i>.linear_fc1.weight`` ...), the same
state dict and sharded state dict (local experts mapped to their global index, so a
checkpoint moves between the two implementations and across expert-parallel layouts) --
whose forward stacks the local experts' weights and runs fc1 and fc2 of all of them as one
``torch._grouped_mm`` each, as torchtitan's MoE does. The dispatcher hands over the tokens
sorted by expert, so expert ``e`` owns rows ``offs[e-1]:offs[e]`` of one ``[tokens, h]``
matrix, ``offs`` the running sum of the tokens per expert.

What ``torch._grouped_mm`` needs (torch 2.9+ on the CPU, 2.8+ on CUDA; ``aten/src/ATen/
native/GroupedMMUtils.h`` and ``cuda/GroupedBlas.cpp``): fp32, bf16 or fp16 operands whose
rows are 16-byte aligned (the hidden size and an expert's width per tensor-parallel rank a
multiple of 16 bytes: checked at start-up, ``model.moe.experts_impl``), int32 offsets. On
CUDA it runs its CUTLASS grouped GEMM for bf16 on sm90/sm100 (Hopper, Blackwell) and a loop
of GEMMs otherwise. Token groups need no alignment in bf16 (the groups are slices along
rows; only fp8 and the block-scaled formats want them padded).

What it costs beside the GEMMs: the stacked weights are a copy made every forward and kept
for the backward (one more copy of the local experts' weights per MoE layer in flight).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: ``torch._grouped_mm``'s
    backward refuses a broadcast gradient (strides 0, e.g. from a ``sum()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` whose local experts run as two grouped GEMMs (module doc)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        c = self.config
        unsupported = [name for name, off in (
            ("gated_linear_unit", c.gated_linear_unit),
            ("add_bias_linear", not c.add_bias_linear),
            ("moe_apply_probs_on_input", not c.moe_apply_probs_on_input),
            ("activation_func_clamp_value", c.activation_func_clamp_value is None),
            ("glu_linear_offset", c.glu_linear_offset == 0.0),
            ("fp8/fp4", not (c.fp8 or c.fp4))) if not off]
        if unsupported:
            raise ValueError(f"GroupedExperts runs bias-free SwiGLU experts only; this config "
                             f"sets {', '.join(unsupported)}")

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        """``[tokens, h]`` sorted by local expert, ``[local experts]`` tokens each (on any
        device), ``[tokens]`` routing weights -> ``([tokens, h], None)``."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if x.shape[0] == 0:  # nothing routed here: torch._grouped_mm's backward refuses it
            return super().forward(x, tokens_per_expert, probs)
        offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32).to(x.device,
                                                                        non_blocking=True)
        # [E, 2f, h] and [E, h, f]: nn.Linear's [out, in] per expert; read transposed
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])
        h = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)  # [tokens, 2f]
        gate, up = torch.chunk(h, 2, dim=-1)
        # as Megatron's MLP: SwiGLU in the activations' dtype, then the fp32 routing weight
        act = (self.config.activation_func(gate) * up * probs.unsqueeze(-1)).to(x.dtype)
        out = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [tokens, h]
        return _ContiguousGrad.apply(out), None

