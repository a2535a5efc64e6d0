"""mHC stream mixing ops: ``reference.py`` (plain PyTorch, the source of truth) and the
fused Triton kernels (``function.py``, same signatures; imported on first use, so that
importing this package needs no Triton and the interpreter switch in the environment is
read in time).

Per sublayer: ``mhc_read_*`` (launch 1: RMSNorm, coefficient projection, gates, biases,
activations, Sinkhorn-Knopp, ``H_pre X``) and ``mhc_post_res_*`` (launch 2:
``H_res X + H_post^T y``); ``sinkhorn_*`` on its own. The op a sublayer runs is the pair,
:class:`MHCOps` (``mhc_reference`` / ``mhc_triton``), picked with
``dispatch.select("mhc", impl)``.
"""

from depthmix.kernels.dispatch import lazy_attribute
from depthmix.kernels.mhc.reference import (
    MHCOps,
    mhc_coefficients,
    mhc_post_res_reference,
    mhc_pre,
    mhc_read_reference,
    mhc_reference,
    sinkhorn_reference,
)

IMPLS = {"torch": ".reference:mhc_reference", "triton": ".function:mhc_triton"}
"""Resolved ``mixer.impl`` -> where the implementation (a :class:`MHCOps`) lives."""

_TRITON = (".function:mhc_read_triton", ".function:mhc_post_res_triton",
           ".function:sinkhorn_triton")


def __getattr__(name):
    return lazy_attribute(__name__, name, (*IMPLS.values(), *_TRITON))


__all__ = [
    "IMPLS",
    "MHCOps",
    "mhc_coefficients",
    "mhc_post_res_reference",
    "mhc_post_res_triton",
    "mhc_pre",
    "mhc_read_reference",
    "mhc_read_triton",
    "mhc_reference",
    "mhc_triton",
    "sinkhorn_reference",
    "sinkhorn_triton",
]
