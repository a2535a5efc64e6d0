"""Mixture-of-depths attention (``moda_attention``).

``moda_attention_reference`` is plain PyTorch, the source of truth. With the same
arguments, imported on first use:

* ``moda_attention_triton`` (``split.py``, the ``mixer.impl=triton`` default,
  ``mixer.moda_kernel=split``): the sequence part through SDPA's flash / cuDNN attention,
  the depth part through a small Triton kernel (``triton.py``), merged exactly by their
  log-sum-exps;
* ``moda_attention_fused`` (``function.py``, ``mixer.moda_kernel=fused``): one flash-style
  Triton kernel for both parts (``triton.py``).

The MoDA core attention picks one with ``dispatch.select("moda_attention", impl)`` (and
the fused kernel for ``mixer.moda_kernel=fused``).
"""

from depthmix.kernels.dispatch import lazy_attribute
from depthmix.kernels.moda_attention.reference import (
    moda_attention_reference,
    moda_depth_weights,
)

IMPLS = {"torch": ".reference:moda_attention_reference",
         "triton": ".split:moda_attention_triton"}
"""Resolved ``mixer.impl`` -> where the implementation lives."""
KERNELS = {"split": IMPLS["triton"], "fused": ".function:moda_attention_fused"}
"""``mixer.moda_kernel`` -> the Triton implementation it names."""


def __getattr__(name):
    return lazy_attribute(__name__, name, (*IMPLS.values(), *KERNELS.values()))


__all__ = ["IMPLS", "KERNELS", "moda_attention_fused", "moda_attention_reference",
           "moda_attention_triton", "moda_depth_weights"]
