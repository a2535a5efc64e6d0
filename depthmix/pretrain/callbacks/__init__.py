"""Lifecycle callbacks (OLMo-core style): checkpoints, preemption, console, progress, depth
statistics and the expert-load heatmap, W&B, profiler, closing summary."""

from depthmix.pretrain.callbacks.base import Callback
from depthmix.pretrain.callbacks.checkpoint import CheckpointCallback
from depthmix.pretrain.callbacks.console import ConsoleLogger, ProgressBar
from depthmix.pretrain.callbacks.depth_stats import DepthStatsCallback
from depthmix.pretrain.callbacks.expert_heatmap import ExpertLoadHeatmap
from depthmix.pretrain.callbacks.preemption import PreemptionCallback
from depthmix.pretrain.callbacks.profiler import ProfilerCallback
from depthmix.pretrain.callbacks.summary import RunSummary
from depthmix.pretrain.callbacks.wandb import WandbLogger

__all__ = ["Callback", "CheckpointCallback", "ConsoleLogger", "DepthStatsCallback",
           "ExpertLoadHeatmap", "PreemptionCallback", "ProfilerCallback", "ProgressBar",
           "RunSummary", "WandbLogger"]
