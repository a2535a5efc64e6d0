"""The torch dtype of each ``train.precision``. The names and which dtype each means are
:data:`depthmix.config.validate.TORCH_DTYPES` (torch-free, for the option checks and the
command lines); this looks the dtype up."""

from __future__ import annotations

import torch

from depthmix.config.validate import TORCH_DTYPES


def torch_dtype(precision: str) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` -> ``torch.float32`` / ``torch.bfloat16`` /
    ``torch.float16``."""
    return getattr(torch, TORCH_DTYPES[precision])
