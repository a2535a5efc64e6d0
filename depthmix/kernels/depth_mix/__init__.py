"""Depth-Attention's depth step: ``depth_mix`` (and the weights it uses, ``depth_weights``).

``depth_mix_reference`` (``reference.py``) is plain PyTorch with fp32 statistics, the
source of truth; ``depth_mix_triton`` (``function.py``) is the fused Triton kernel with the
same signature, imported on first use so that importing this package never needs Triton.
Modules pick one with ``dispatch.select("depth_mix", impl)``.
"""

from depthmix.kernels.depth_mix.reference import depth_mix_reference, depth_weights
from depthmix.kernels.dispatch import lazy_attribute

IMPLS = {"torch": ".reference:depth_mix_reference", "triton": ".function:depth_mix_triton"}
"""Resolved ``mixer.impl`` -> where the implementation lives."""


def __getattr__(name):
    return lazy_attribute(__name__, name, IMPLS.values())


__all__ = ["IMPLS", "depth_mix_reference", "depth_mix_triton", "depth_weights"]
