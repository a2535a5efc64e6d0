"""Depth statistics (``depthmix.pretrain.callbacks.depth_stats``): the summaries of the
mixers' statistics per layer, the heatmap's colours and its PNG file."""

import numpy as np
import pytest
import torch

from depthmix.pretrain.callbacks import depth_stats

from png_files import read_png


def test_png_round_trip():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (7, 5, 3), dtype=np.uint8)
    assert np.array_equal(read_png(depth_stats.png_bytes(rgb)), rgb)
    grey = rng.integers(0, 256, (3, 9), dtype=np.uint8)
    assert np.array_equal(read_png(depth_stats.png_bytes(grey)), grey)
    with pytest.raises(ValueError):
        depth_stats.png_bytes(np.zeros((2, 2, 4), dtype=np.uint8))


def test_heatmap_colours():
    image = depth_stats.render(np.array([[0.0, 1.0], [np.nan, 0.5]]), cell=4)
    assert image.shape == (8, 8, 3)
    assert tuple(image[0, 0]) == (68, 1, 84)  # minimum: viridis dark purple
    assert tuple(image[0, 4]) == (253, 231, 37)  # maximum: yellow
    assert tuple(image[4, 0]) == (235, 235, 235)  # missing
    assert tuple(image[3, 0]) == (255, 255, 255)  # grid line


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
