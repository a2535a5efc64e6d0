"""Attention-Residuals depth aggregation (``attnres``).

``attnres_reference`` is plain PyTorch (fp32 statistics), the source of truth;
``fused_attnres`` is the fused Triton kernel with the same signature (sources read in
place through a pointer table, backward from per-token statistics). The mixers pick one
at construction with :func:`attnres_op` from the start-up resolved ``mixer.impl``.
"""

from depthmix.kernels.attnres.reference import attnres_reference

try:
    from depthmix.kernels.attnres.function import fused_attnres
except ModuleNotFoundError as e:  # triton is a Linux x86-64 dependency only
    if e.name != "triton":
        raise
    fused_attnres = None

attnres = attnres_reference
"""The PyTorch path (``mixer.impl=torch``)."""


def attnres_op(impl: str):
    """The op for a resolved ``mixer.impl`` (``torch`` or ``triton``)."""
    if impl == "triton":
        if fused_attnres is None:
            raise RuntimeError("mixer.impl=triton but the triton package is not importable")
        return fused_attnres
    if impl == "torch":
        return attnres_reference
    raise ValueError(f"attnres_op: impl={impl!r} is not resolved (torch or triton)")


__all__ = ["attnres", "attnres_op", "attnres_reference", "fused_attnres"]
