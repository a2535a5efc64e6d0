"""What the training process reads of its device: the name the device table is looked up by,
and the memory the log line and W&B report."""

from __future__ import annotations

from typing import Dict, Optional

import psutil
import torch

from depthmix.planning.units import GIB


def switch_on(mode: str) -> bool:
    """A fast-path switch (``train.compile``, ``train.fused_optimizer``,
    ``train.fused_cross_entropy``): ``true``, or ``auto`` where CUDA is (off on the CPU,
    whose default path the golden losses pin)."""
    return torch.cuda.is_available() if mode == "auto" else mode == "true"


def device_name() -> Optional[str]:
    """``torch.cuda.get_device_name()``, or None without a GPU."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def memory_stats() -> Dict[str, float]:
    """GiB: peak allocated on the GPU (``mem/peak_alloc_gib``), or the process RSS on CPU."""
    if torch.cuda.is_available():
        return {"mem/peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB,
                "mem/reserved_gib": torch.cuda.memory_reserved() / GIB}
    return {"mem/rss_gib": psutil.Process().memory_info().rss / GIB}
