"""The unit ``tools/bench_kernels.py`` times (one shape of one op, several candidates) and
the public plain-attention baseline the attention-shaped ops compare with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch


@dataclass
class Case:
    op: str
    shape: str
    make_inputs: Callable[[], tuple]
    """Returns ``(args, kwargs)``; tensors that need gradients have requires_grad set."""
    candidates: Dict[str, Callable] = field(default_factory=dict)
    """``ours`` (the Triton kernel), ``torch`` (our PyTorch path), ``compile``
    (torch.compile of it) and public kernels when importable."""
    baseline: str = "torch"
    """The candidate the ratio column divides by (e.g. plain attention for "attention +
    depth mix" cases)."""


def implementations(op: str, cuda: bool) -> Dict[str, Callable]:
    """Our candidates for kernel ``op``: ``ours`` (the Triton kernel, where Triton can
    run), ``torch`` (the reference) and, on CUDA, ``compile`` (the reference under
    ``torch.compile``)."""
    from depthmix.kernels.dispatch import select, triton_status

    out = {"ours": select(op, "triton")} if triton_status()[0] else {}
    out["torch"] = select(op, "torch")
    if cuda:
        out["compile"] = torch.compile(out["torch"], dynamic=False)
    return out


def fla_causal_attention() -> Optional[Callable]:
    """fla-core's ``parallel_attn`` with ``causal_sdpa``'s layout (``[s, b, h, d]`` in,
    ``[s, b, h * d]`` out), or None when fla-core is not importable (it is GPU-only)."""
    try:
        from fla.ops.attn import parallel_attn
    except Exception:
        return None

    def attention(query, key, value):
        out = parallel_attn(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1))
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    return attention
