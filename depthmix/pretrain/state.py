"""Where a run stands, apart from its weights and optimizer: owned by the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from depthmix.checkpoint.store import read_run_id


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
    unconfirmed: Optional[str] = None
    """The healthy checkpoint saved after the last step, until the next step settles its
    health mark (not saved)."""

    @classmethod
    def fresh(cls, save_dir: str) -> "TrainState":
        return cls(save_dir=save_dir, run_id=read_run_id(save_dir))
