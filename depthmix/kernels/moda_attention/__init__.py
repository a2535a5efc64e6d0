"""Mixture-of-depths attention (``moda_attention``).

``moda_attention_reference`` is plain PyTorch, the source of truth;
``moda_attention_triton`` is the fused, flash-style Triton kernel with the same arguments
(``triton.py``, autograd in ``function.py``), imported on first use. The MoDA core
attention picks one with ``dispatch.select("moda_attention", impl)``.
"""

from depthmix.kernels.dispatch import lazy_attribute
from depthmix.kernels.moda_attention.reference import (
    moda_attention_reference,
    moda_depth_weights,
)

IMPLS = {"torch": ".reference:moda_attention_reference",
         "triton": ".function:moda_attention_triton"}
"""Resolved ``mixer.impl`` -> where the implementation lives."""


def __getattr__(name):
    return lazy_attribute(__name__, name, IMPLS.values())


__all__ = ["IMPLS", "moda_attention_reference", "moda_attention_triton", "moda_depth_weights"]
