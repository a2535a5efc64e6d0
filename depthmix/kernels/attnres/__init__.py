"""Attention-Residuals depth aggregation (``attnres``).

``attnres_reference`` is plain PyTorch (fp32 statistics), the source of truth;
``attnres_triton`` is the fused Triton kernel with the same signature (sources read in
place through a pointer table, backward from per-token statistics), imported on first
use. Modules pick one with ``dispatch.select("attnres", impl)``.
"""

from depthmix.kernels.attnres.reference import attnres_reference
from depthmix.kernels.dispatch import lazy_attribute

IMPLS = {"torch": ".reference:attnres_reference", "triton": ".function:attnres_triton"}
"""Resolved ``mixer.impl`` -> where the implementation lives."""


def __getattr__(name):
    return lazy_attribute(__name__, name, IMPLS.values())


__all__ = ["IMPLS", "attnres_reference", "attnres_triton"]
