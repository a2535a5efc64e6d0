"""Mixture-of-depths attention (``moda_attention``).

``moda_attention_reference`` is plain PyTorch (fp32 softmax); the fused, flash-style
Triton kernel with the same signature is issue 9's. ``moda_attention`` is what the MoDA
core attention calls.
"""

from depthmix.kernels.moda_attention.reference import (
    moda_attention_reference,
    moda_depth_weights,
)

moda_attention = moda_attention_reference

__all__ = ["moda_attention", "moda_attention_reference", "moda_depth_weights"]
