"""Attention-Residuals depth aggregation (``attnres``).

``attnres_reference`` is plain PyTorch (fp32 statistics); the fused Triton kernel with
the same signature is issue 9's. ``attnres`` is what the mixers call.
"""

from depthmix.kernels.attnres.reference import attnres_reference

attnres = attnres_reference

__all__ = ["attnres", "attnres_reference"]
