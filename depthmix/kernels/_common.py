"""Host-side helpers shared by the Triton launchers (``kernels/<op>/triton.py``).

Nothing here imports Triton at module level, so the dispatcher can use it too.
"""

from __future__ import annotations

import os
from typing import List, Optional

import torch
from torch import Tensor


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``, tests only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / statistics dtype: fp32 for 16-bit and fp32 inputs, fp64 for fp64
    (like the references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_dtype(dtype: torch.dtype):
    """The ``triton.language`` dtype of a torch float dtype (fp32 or fp64)."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float64: tl.float64}[dtype]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs the
    programs one after another)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def last_dim_contiguous(*tensors: Optional[Tensor]) -> List[Optional[Tensor]]:
    """Each tensor with unit stride in its last dim (a copy only where it has not; None
    passes through): what the kernels' row loads assume."""
    return [t if t is None or t.stride(-1) == 1 else t.contiguous() for t in tensors]


# ---- custom ops ---------------------------------------------------------------------------
# Each op's launchers run behind ``torch.library.custom_op`` (``<op>/function.py``): an
# opaque node with a fake implementation (output shapes, dtypes and strides, for tracing)
# and a registered autograd formula whose backward is itself a custom op. ``torch.compile``
# then keeps a Triton op inside a compiled layer's graph instead of breaking it there, and
# Inductor fuses the PyTorch work around it. ``custom_op`` rather than ``triton_op``: the
# launchers pick tiles on the host and attnres passes its sources as a table of
# ``data_ptr()`` values, which Inductor cannot trace (and need not: the kernel is already
# fused). A custom op's schema has no optional outputs, so an output the options do not
# produce is an empty 1-D tensor on the way out (:func:`present`) and None again once
# outside (:func:`absent`); no real output or gradient of these ops is 1-D and empty.


def empty_like_contiguous(t: Tensor) -> Tensor:
    """What a launcher allocates for an output shaped like ``t`` (a fake implementation's
    output): same shape, dtype and device, contiguous strides."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def present(t: Optional[Tensor], like: Tensor) -> Tensor:
    """``t``, or an empty 1-D placeholder of ``like``'s dtype and device for None."""
    return like.new_empty(0) if t is None else t


def absent(t: Optional[Tensor]) -> Optional[Tensor]:
    """None for a :func:`present` placeholder (or None), else ``t``."""
    return None if t is None or (t.dim() == 1 and t.numel() == 0) else t
