"""mHC stream mixing ops: ``reference`` (plain PyTorch, the source of truth) and the fused
Triton kernels (``fused_*``, same signatures; imported on first use, so that importing this
package needs no Triton and the interpreter switch in the environment is read in time).

Per sublayer: ``fused_mhc_read`` (launch 1: RMSNorm, coefficient projection, gates, biases,
activations, Sinkhorn-Knopp, ``H_pre X``) and ``fused_mhc_post_res`` (launch 2:
``H_res X + H_post^T y``); ``fused_sinkhorn`` on its own.
"""

from depthmix.kernels.mhc.reference import (
    VARIANTS,
    coefficient_width,
    mhc_coefficients,
    mhc_post_res,
    mhc_pre,
    mhc_read,
    sinkhorn,
)

_FUSED = ("fused_mhc_post_res", "fused_mhc_read", "fused_sinkhorn")


def __getattr__(name):
    if name in _FUSED:
        from depthmix.kernels.mhc import function

        return getattr(function, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "VARIANTS",
    "coefficient_width",
    "fused_mhc_post_res",
    "fused_mhc_read",
    "fused_sinkhorn",
    "mhc_coefficients",
    "mhc_post_res",
    "mhc_pre",
    "mhc_read",
    "sinkhorn",
]
