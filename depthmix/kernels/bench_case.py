"""The unit ``tools/bench_kernels.py`` times: one shape of one op, several candidates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict


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
