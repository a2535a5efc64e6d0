"""Lifecycle callbacks (OLMo-core style): console logging, W&B, checkpoints, ..."""

from depthmix.pretrain.callbacks.base import Callback
from depthmix.pretrain.callbacks.console import ConsoleLogger

__all__ = ["Callback", "ConsoleLogger"]
