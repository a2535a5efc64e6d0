"""Mixture-of-depths attention (``moda_attention``).

``moda_attention`` is the fused, flash-style Triton kernel (``triton.py``, autograd in
``function.py``); ``moda_attention_reference`` is plain PyTorch with the same arguments and
the source of truth. The MoDA core attention picks one from ``mixer.impl``
(``triton`` / ``torch``) when it is built.
"""

from depthmix.kernels.moda_attention.function import moda_attention_triton
from depthmix.kernels.moda_attention.reference import (
    moda_attention_reference,
    moda_depth_weights,
)

moda_attention = moda_attention_triton

IMPLEMENTATIONS = {"torch": moda_attention_reference, "triton": moda_attention_triton}
"""Resolved ``mixer.impl`` -> implementation."""


def get_moda_attention(impl: str):
    """The ``moda_attention`` implementation for ``mixer.impl`` (``torch``/``triton``;
    ``auto`` is resolved here if start-up did not)."""
    if impl == "auto":
        from depthmix.kernels.dispatch import resolve_impl

        impl = resolve_impl(impl)[0]
    return IMPLEMENTATIONS[impl]


__all__ = ["IMPLEMENTATIONS", "get_moda_attention", "moda_attention",
           "moda_attention_reference", "moda_attention_triton", "moda_depth_weights"]
