"""The expert-load heatmap, beside the depth heatmaps: per layer and expert, the share of the
layer's token-expert assignments that expert received, over the steps since the previous
heatmap.

Every ``logger.depth_stats_interval`` steps -- at the first log step on or after each
multiple of it, since the counts come from the log steps' reading of the routers
(:class:`~depthmix.pretrain.experts.ExpertLoad`, every rank holds every layer) -- the
logging rank sums the readings since the previous heatmap into a ``[layers, experts]``
matrix of shares (each MoE layer's row sums to 1; dense layers are NaN), draws it with the
depth heatmaps' :func:`~depthmix.pretrain.callbacks.depth_stats.render` on a fixed scale
(0 to twice the balanced share ``1 / experts``: a balanced layer is the scale's middle
colour, an expert at twice its share or more the top one), writes it to
``<output_dir>/depth_stats/expert_load/step_<k>.png`` and hands it to the loggers that take
it (``log_expert_load``: W&B's ``moe/expert_load/heatmap``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

from depthmix.pretrain.callbacks.base import Callback
from depthmix.pretrain.callbacks.depth_stats import render

NAME = "expert_load"
"""The heatmap's folder under ``<output_dir>/depth_stats`` and its W&B key's middle part."""


@dataclass
class ExpertHeatmap:
    """One heatmap, on the logging rank."""

    step: int
    first_step: int
    """The steps it covers: ``first_step`` to ``step``."""
    share: np.ndarray
    """``[layers, experts]``: each MoE layer's assignments per expert over their sum."""
    image: np.ndarray
    """``[layers * cell, experts * cell, 3]`` uint8."""

    @property
    def caption(self) -> str:
        experts = self.share.shape[1]
        return (f"expert load, steps {self.first_step}-{self.step}: rows = layers, columns = "
                f"experts; share of the layer's assignments, 0 to {2 / experts:.3g} "
                f"(balanced {1 / experts:.3g})")


def load_share(tokens: Dict[int, List[float]], num_layers: int, num_experts: int) -> np.ndarray:
    """``{layer: assignments per expert}`` -> ``[num_layers, num_experts]`` shares (NaN rows:
    dense layers, or a layer that took no tokens)."""
    share = np.full((num_layers, num_experts), np.nan)
    for u, counts in tokens.items():
        counts = np.asarray(counts, dtype=np.float64)
        if counts.sum() > 0:
            share[u] = counts / counts.sum()
    return share


def draw(share: np.ndarray) -> np.ndarray:
    """The heatmap of a share matrix on the fixed scale of the module doc."""
    return render(share, vmin=0.0, vmax=2.0 / share.shape[1])


class ExpertLoadHeatmap(Callback):
    """On the logging rank of a model with experts: the heatmap every
    ``logger.depth_stats_interval`` steps (module doc); ``log_expert_load(trainer, heatmap)``
    of each of ``consumers``."""

    def __init__(self, consumers: Sequence = ()):
        self.consumers = list(consumers)
        self.tokens: Dict[int, np.ndarray] = {}
        self.last = 0
        """The step of the previous heatmap (or where this run segment started)."""

    def pre_train(self, trainer) -> None:
        self.tokens, self.last = {}, trainer.step

    def post_restore(self, trainer) -> None:  # rolled back: start over from there
        self.pre_train(trainer)

    def post_step(self, trainer, result) -> None:
        load, interval = result.experts, trainer.run.logger.depth_stats_interval
        if load is None or not interval or not trainer.topo.is_logging_rank:
            return
        for u in load.layers:
            counts = np.asarray(load.tokens[u], dtype=np.float64)
            self.tokens[u] = self.tokens.get(u, 0) + counts
        if trainer.step // interval == self.last // interval:  # no multiple passed yet
            return
        from PIL import Image

        share = load_share(self.tokens, trainer.run.model.num_layers,
                           trainer.run.model.experts.num_experts)
        heatmap = ExpertHeatmap(trainer.step, self.last + 1, share, draw(share))
        self.tokens, self.last = {}, trainer.step
        directory = os.path.join(trainer.run.output_dir, "depth_stats", NAME)
        os.makedirs(directory, exist_ok=True)
        Image.fromarray(heatmap.image).save(os.path.join(directory,
                                                         f"step_{trainer.step:07d}.png"))
        for consumer in self.consumers:
            consumer.log_expert_load(trainer, heatmap)
