"""Depth statistics (``depthmix.pretrain.callbacks.depth_stats``): the summaries of the
mixers' statistics per layer and the heatmap's colours."""

import numpy as np
import pytest
import torch

from depthmix.pretrain.callbacks import depth_stats


def test_heatmap_colours():
    """matplotlib's viridis from the smallest to the largest value, NaN grey, a white grid."""
    from matplotlib import colormaps

    image = depth_stats.render(np.array([[0.0, 1.0], [np.nan, 0.5]]), cell=4)
    assert image.shape == (8, 8, 3) and image.dtype == np.uint8
    viridis = colormaps["viridis"]
    assert tuple(image[0, 0]) == tuple(viridis(0.0, bytes=True)[:3]) == (68, 1, 84)
    assert tuple(image[0, 4]) == tuple(viridis(1.0, bytes=True)[:3])  # yellow
    assert tuple(image[4, 4]) == tuple(viridis(0.5, bytes=True)[:3])
    assert tuple(image[4, 0]) == depth_stats.MISSING
    assert tuple(image[3, 0]) == (255, 255, 255)  # grid line
    flat = depth_stats.render(np.array([[0.3, 0.3]]), cell=1)  # one value: the bottom colour
    assert flat.shape == (1, 2, 3) and (flat == image[0, 0]).all()


def test_summarise_depth_stats():
    stats = {
        "layer0/w": torch.tensor([1.0]),
        "layer2/w": torch.tensor([[0.2, 0.3, 0.5], [0.4, 0.3, 0.3]]),  # per head: averaged
        "layer2/gate": torch.tensor(0.7),
        "ignored": torch.tensor([1.0]),
    }
    matrices, scalars = depth_stats.summarise(stats)
    m = matrices["w"]
    assert m.shape == (3, 3)
    assert np.allclose(m[2], [0.3, 0.3, 0.4]) and np.isnan(m[1]).all() and m[0, 0] == 1.0
    p = np.array([0.3, 0.3, 0.4])
    assert scalars["depth/w/entropy/layer2"] == pytest.approx(-(p * np.log(p)).sum())
    assert scalars["depth/w/entropy/layer0"] == 0.0
    assert scalars["depth/w/max/layer2"] == pytest.approx(0.4)
    assert scalars["depth/gate/layer2"] == pytest.approx(0.7)
