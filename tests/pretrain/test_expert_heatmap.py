"""The expert-load heatmap (``depthmix.pretrain.callbacks.expert_heatmap``) from known counts:
the log steps' readings summed until a multiple of ``logger.depth_stats_interval`` passes,
each expert's share of its layer drawn on the depth heatmaps' scale (0 to twice the
balanced share), dense layers grey, the PNG where the depth heatmaps go and the same image
handed to the loggers. The W&B files holding it: tests/pretrain/test_wandb.py."""

from types import SimpleNamespace

import numpy as np
from matplotlib import colormaps
from PIL import Image

from depthmix.pretrain.callbacks.depth_stats import MISSING
from depthmix.pretrain.callbacks.expert_heatmap import ExpertLoadHeatmap
from depthmix.pretrain.experts import ExpertLoad


def reading(tokens: dict) -> SimpleNamespace:
    """A step result whose expert load has ``tokens`` (layer -> per-expert assignments)."""
    load = ExpertLoad(layers=sorted(tokens), tokens=tokens,
                      assigned={u: sum(t) for u, t in tokens.items()}, aux_loss=None, z_loss=None)
    return SimpleNamespace(experts=load)


class Consumer:
    def __init__(self):
        self.got = []

    def log_expert_load(self, trainer, heatmap):
        self.got.append(heatmap)


def colour(value: float) -> tuple:
    return tuple(colormaps["viridis"](value, bytes=True)[:3])


def test_heatmap_of_known_counts(tmp_path):
    run = SimpleNamespace(output_dir=str(tmp_path),
                          logger=SimpleNamespace(depth_stats_interval=4),
                          model=SimpleNamespace(num_layers=3,
                                                experts=SimpleNamespace(num_experts=4)))
    trainer = SimpleNamespace(run=run, step=0, topo=SimpleNamespace(is_logging_rank=True))
    consumer = Consumer()
    callback = ExpertLoadHeatmap(consumers=[consumer])
    callback.pre_train(trainer)
    # log steps 2, 4, 6, 8; layer 0 is dense; layer 2 takes nothing on expert 3
    readings = {2: {1: [10, 10, 10, 10], 2: [30, 5, 5, 0]},
                4: {1: [10, 10, 10, 10], 2: [10, 15, 15, 0]},
                6: {1: [40, 0, 0, 0], 2: [0, 0, 0, 40]}}
    for step in range(1, 9):
        trainer.step = step
        callback.post_step(trainer, reading(readings[step]) if step in readings
                           else SimpleNamespace(experts=None))
    (heatmap,) = consumer.got  # step 8 is a multiple of 4, but no log step read it
    assert (heatmap.step, heatmap.first_step) == (4, 1)
    share = heatmap.share
    assert np.isnan(share[0]).all()
    np.testing.assert_allclose(share[1], [0.25] * 4)
    np.testing.assert_allclose(share[2], [0.5, 0.25, 0.25, 0.0])  # 40, 20, 20, 0 of 80
    png = tmp_path / "depth_stats" / "expert_load" / "step_0000004.png"
    image = np.asarray(Image.open(png))
    assert np.array_equal(image, heatmap.image) and image.shape == (3 * 12, 4 * 12, 3)
    cell = lambda u, e: tuple(image[u * 12 + 5, e * 12 + 5])  # noqa: E731
    assert cell(0, 0) == MISSING  # the dense layer
    assert cell(1, 0) == colour(0.5)  # balanced: the middle of 0 .. 2/4
    assert cell(2, 0) == colour(1.0)  # twice the balanced share: the top
    assert cell(2, 1) == colour(0.5) and cell(2, 3) == colour(0.0)
    assert "steps 1-4" in heatmap.caption
    trainer.step = 12  # the next reading: steps 5-12, from steps 6 and 12
    callback.post_step(trainer, reading({1: [0, 0, 0, 0], 2: [0, 0, 0, 40]}))
    assert (consumer.got[1].first_step, consumer.got[1].step) == (5, 12)
    np.testing.assert_allclose(consumer.got[1].share[1], [1.0, 0, 0, 0])
    np.testing.assert_allclose(consumer.got[1].share[2], [0, 0, 0, 1.0])
