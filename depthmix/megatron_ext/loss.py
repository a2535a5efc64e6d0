"""The LM head and its loss without the full logits (``train.fused_cross_entropy``).

Megatron's path multiplies the final hidden states by the output weight into logits
``[s, b, vocab/tp]`` in the model dtype, copies them to fp32 and keeps the fp32 softmax for
backward (``vocab_parallel_cross_entropy``): at 4096 tokens and a 50k vocabulary that is
0.4 GB of bf16 logits, 0.8 GB of fp32 logits and 0.8 GB of saved softmax per micro-batch.
:func:`linear_cross_entropy` instead runs over chunks of tokens: each chunk's logits
``[chunk, vocab/tp]`` are made in the model dtype, their log-sum-exp and target logit taken
in fp32, and only two fp32 numbers per token are kept; backward recomputes each chunk's
logits and produces the gradients of the hidden states and of the output weight. Under
tensor parallelism the vocabulary is split as in Megatron's ``vocab_parallel_cross_entropy``:
each rank reduces its shard, then one MAX and one SUM all-reduce over the TP group combine
the log-sum-exps and pick the target logit from the rank that holds it. The same idea as
Liger-Kernel's fused linear cross-entropy and torchtune's chunked output loss, written here
in plain PyTorch (GEMMs in the model dtype, reductions in fp32).

:class:`OutputLayer` is Megatron's ``ColumnParallelLinear`` (same parameters, sharding and
checkpoint keys); called with ``labels`` it returns the per-token loss through this path.
Going through the module keeps its forward pre-hooks (the distributed optimizer's
overlapped parameter all-gather waits there).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from torch import Tensor

from depthmix.config.schema import RunConfig
from depthmix.runtime.device import switch_on

CHUNK_BYTES = 256 * 2**20
"""fp32 logits per chunk (the transient peak of one chunk is about 1.5x this: the logits in
the model dtype beside their fp32 copy)."""
CHUNK_MULTIPLE = 128
"""Chunks are a multiple of this many tokens (GEMM-friendly row counts)."""


def enabled(run: RunConfig) -> bool:
    """``train.fused_cross_entropy``: ``true``, or ``auto`` on CUDA."""
    return switch_on(run.train.fused_cross_entropy)


def chunk_tokens(vocab_local: int) -> int:
    """Tokens per chunk for a vocabulary shard of ``vocab_local`` rows: :data:`CHUNK_BYTES`
    of fp32 logits, rounded down to :data:`CHUNK_MULTIPLE` (at least one multiple)."""
    tokens = CHUNK_BYTES // (4 * vocab_local)
    return max(CHUNK_MULTIPLE, tokens // CHUNK_MULTIPLE * CHUNK_MULTIPLE)


class _LinearCrossEntropy(torch.autograd.Function):
    """``hidden [n, h]``, ``weight [v, h]`` (this rank's vocabulary rows ``start ..
    start + v``), ``target [n]`` (global ids) -> loss ``[n]`` in fp32 (fp64 for fp64
    inputs)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, start: int,
                group, chunk: int) -> Tensor:
        n, v = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 for 16-bit, fp64 stays
        local = target - start
        mine = (local >= 0) & (local < v)  # this rank holds the target's logit
        local = local.clamp(0, v - 1)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        picked = torch.empty_like(lse)
        for i in range(0, n, chunk):
            logits = (hidden[i:i + chunk] @ weight.t()).to(acc)  # [c, v]
            picked[i:i + chunk] = logits.gather(1, local[i:i + chunk, None]).squeeze(1)
            top = logits.amax(dim=-1, keepdim=True)  # log-sum-exp in place: no second chunk
            lse[i:i + chunk] = logits.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
            del logits  # before the next chunk's GEMM allocates
        picked = torch.where(mine, picked, torch.zeros_like(picked))
        if group is not None and dist.get_world_size(group) > 1:
            top = lse.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack([(lse - top).exp(), picked])
            dist.all_reduce(sums, group=group)
            lse = top + sums[0].log()
            picked = sums[1]
        ctx.save_for_backward(hidden, weight, local, mine, lse)
        ctx.chunk = chunk
        return lse - picked

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        hidden, weight, local, mine, lse = ctx.saved_tensors
        chunk, n = ctx.chunk, hidden.shape[0]
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # the weight's gradient sums over chunks, in fp32 (one chunk: one GEMM, rounded
        # once, as on the plain path)
        grad_weight = None
        minus_one = -mine.to(lse.dtype)[:, None]
        for i in range(0, n, chunk):
            h = hidden[i:i + chunk]
            probs = (h @ weight.t()).to(lse.dtype).sub_(lse[i:i + chunk, None]).exp_()  # softmax
            probs.scatter_add_(1, local[i:i + chunk, None], minus_one[i:i + chunk])
            grad_logits = probs.mul_(grad_loss[i:i + chunk, None]).to(hidden.dtype)
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[i:i + chunk])
            if want_weight:
                part = grad_logits.t() @ h  # [v, h]
                if grad_weight is None:
                    grad_weight = part if n <= chunk else part.to(lse.dtype)
                else:
                    grad_weight.add_(part)
                del part
            del probs, grad_logits  # before the next chunk's GEMM allocates
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, tp_group=None,
                         sequence_parallel: bool = False,
                         chunk: Optional[int] = None) -> Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T`` against ``labels``, never holding
    more than one chunk's logits.

    ``hidden [s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism: gathered here, its
    gradient reduce-scattered, as ``ColumnParallelLinear`` does), ``weight [vocab/tp, h]``
    (this rank's rows of the vocabulary), ``labels [s, b]`` -> loss ``[s, b]`` fp32.
    ``chunk``: tokens per chunk (default :func:`chunk_tokens`)."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp > 1 and sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, True, group=tp_group)
    elif tp > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)  # bwd: all-reduce
    s, b, h = hidden.shape
    v = weight.shape[0]
    start = dist.get_rank(tp_group) * v if tp > 1 else 0
    loss = _LinearCrossEntropy.apply(hidden.reshape(s * b, h), weight, labels.reshape(-1),
                                     start, tp_group if tp > 1 else None,
                                     chunk or chunk_tokens(v))
    return loss.view(s, b)


class OutputLayer(ColumnParallelLinear):
    """The LM head: Megatron's ``ColumnParallelLinear`` (``forward(hidden, weight)`` ->
    ``(logits [s, b, vocab/tp], None)``), and with ``labels [b, s]`` the per-token loss
    ``([b, s], None)`` through :func:`linear_cross_entropy`."""

    def forward(self, input_: Tensor, weight: Optional[Tensor] = None,
                runtime_gather_output: Optional[bool] = None,
                labels: Optional[Tensor] = None):
        if labels is None:
            return super().forward(input_, weight, runtime_gather_output)
        weight = self.weight if weight is None else weight
        loss = linear_cross_entropy(input_, weight, labels.transpose(0, 1).contiguous(),
                                    self.tp_group, self.sequence_parallel)
        return loss.transpose(0, 1).contiguous(), None
