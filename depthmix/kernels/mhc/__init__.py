"""mHC stream mixing ops (``reference``: plain PyTorch; a fused Triton kernel is issue 9)."""

from depthmix.kernels.mhc.reference import (
    VARIANTS,
    coefficient_width,
    mhc_coefficients,
    mhc_post_res,
    mhc_pre,
    sinkhorn,
)

__all__ = [
    "VARIANTS",
    "coefficient_width",
    "mhc_coefficients",
    "mhc_post_res",
    "mhc_pre",
    "sinkhorn",
]
