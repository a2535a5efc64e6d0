"""Deep Delta Learning's residual ops: ``reference.py`` (plain PyTorch, the source of truth)
and the fused Triton kernels (``function.py``, same signatures; imported on first use, so
that importing this package needs no Triton).

Per sublayer: ``ddl_read_*`` (``x_in = X r``) and ``ddl_write_*`` (the delta update
``X + beta k (v^T - k^T X)`` with its key normalisation, gate and values). The op a
sublayer runs is the pair, :class:`DDLOps` (``ddl_reference`` / ``ddl_triton``), picked
with ``dispatch.select("ddl", impl)``.
"""

from depthmix.kernels.ddl.reference import (
    K_EPS,
    DDLOps,
    ddl_read_reference,
    ddl_reference,
    ddl_write_reference,
)
from depthmix.kernels.dispatch import lazy_attribute

IMPLS = {"torch": ".reference:ddl_reference", "triton": ".function:ddl_triton"}
"""Resolved ``mixer.impl`` -> where the implementation (a :class:`DDLOps`) lives."""

_TRITON = (".function:ddl_read_triton", ".function:ddl_write_triton")


def __getattr__(name):
    return lazy_attribute(__name__, name, (*IMPLS.values(), *_TRITON))


__all__ = [
    "IMPLS",
    "K_EPS",
    "DDLOps",
    "ddl_read_reference",
    "ddl_read_triton",
    "ddl_reference",
    "ddl_triton",
    "ddl_write_reference",
    "ddl_write_triton",
]
