"""Where a run stands, apart from its weights and optimizer: owned by the trainer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

RUN_ID_FILE = "wandb_run_id.txt"
"""In the save directory: the W&B run that this directory's training logs to."""


@dataclass
class TrainState:
    """Restored from the checkpoint a run resumes (by :class:`~depthmix.pretrain.trainer.
    Trainer`, before any callback's ``setup``), saved with every checkpoint."""

    save_dir: str
    """Where this run's checkpoints go (``train.save_dir``, default ``<output_dir>/
    checkpoints``)."""
    step: int = 0
    """Optimizer steps taken (the number of the last finished step)."""
    consumed_samples: int = 0
    """Training samples consumed: the data position."""
    resumed_from: Optional[str] = None
    """The checkpoint this process started from, or None for a fresh start."""
    weights_only: bool = False
    """Resumed with only the checkpoint's weights (``train.load_weights_only``)."""
    run_id: Optional[str] = None
    """The W&B run id of this save directory (``wandb_run_id.txt``), None before one exists."""

    @classmethod
    def fresh(cls, save_dir: str) -> "TrainState":
        return cls(save_dir=save_dir, run_id=read_run_id(save_dir))


def read_run_id(save_dir: str) -> Optional[str]:
    path = os.path.join(save_dir, RUN_ID_FILE)
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def write_run_id(save_dir: str, run_id: str) -> None:
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, RUN_ID_FILE)
    with open(f"{path}.tmp", "w") as f:
        f.write(run_id)
    os.replace(f"{path}.tmp", path)
