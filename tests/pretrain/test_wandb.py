"""W&B offline, 2 ranks at PP=2 (the logging rank is the last stage, rank 1): the local run
files hold the metrics and the resolved config; a run resumed from the checkpoint writes to
the same run id; depth statistics recorded on both stages arrive as heatmaps (PNG files
and W&B images), tables and scalars, and so does the load of experts on both stages."""

import glob
import json
import math
import os

import numpy as np
import pytest
from PIL import Image

from run_harness import make_run, spawn, train
from wandb_files import read_run, run_dirs

pytestmark = pytest.mark.multiproc


def fake_weights(layer: int) -> np.ndarray:
    """What the patched layers record: a softmax over the layer's u+1 sources."""
    x = np.arange(layer + 1, dtype=np.float64) * 0.3 * (layer + 1)
    return np.exp(x) / np.exp(x).sum()


def _record_fake_stats():
    """Make every layer record per-source weights, as a depth mixer would."""
    import torch

    from depthmix.megatron_ext.layer import DepthMixLayer

    original = DepthMixLayer.forward

    def forward(self, state, ctx):
        ctx.record("weights", torch.tensor(fake_weights(ctx.layer)))
        return original(self, state, ctx)

    DepthMixLayer.forward = forward


def _worker(tmp: str) -> dict:
    from depthmix.config.schema import MoEConfig
    from depthmix.pretrain.callbacks import (
        CheckpointCallback,
        DepthStatsCallback,
        ExpertLoadHeatmap,
        WandbLogger,
    )

    _record_fake_stats()
    out = {}
    for name, exit_after in (("first", 4), ("resumed", None)):
        run = make_run(steps=6, pp=2)
        # experts on layers 1 (stage 0) and 3 (stage 1)
        run.model.moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32,
                                  first_dense_layers=1, layer_freq=2)
        run.output_dir = os.path.join(tmp, "out")
        run.logger.wandb, run.logger.mode, run.logger.depth_stats_interval = True, "offline", 2
        run.train.eval_interval, run.train.eval_iters = 2, 1
        run.train.exit_after_steps = exit_after
        wandb_logger = WandbLogger()
        callbacks = [DepthStatsCallback(consumers=[wandb_logger]),
                     ExpertLoadHeatmap(consumers=[wandb_logger]), wandb_logger,
                     CheckpointCallback()]
        out[name], out[f"{name}_facts"] = train(run, callbacks)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("wandb"))
    spawn(_worker, 2, (tmp,), timeout=300)
    out = os.path.join(tmp, "out")
    return {"out": out, "runs": [read_run(d) for d in run_dirs(out)]}


def test_one_rank_logs_and_the_resumed_run_keeps_the_id(runs):
    assert len(runs["runs"]) == 2  # first + resumed, from one rank only
    first, resumed = runs["runs"]
    assert first["id"] == resumed["id"]
    with open(os.path.join(runs["out"], "checkpoints", "wandb_run_id.txt")) as f:
        assert f.read().strip() == first["id"]
    assert [r["_step"] for r in first["history"] if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["_step"] for r in resumed["history"] if "train/loss" in r] == [5, 6]
    # the logger's setup runs before the checkpoint callback's: the trainer restored first
    assert first["config"]["resumed_from"] is None
    assert resumed["config"]["resumed_from"] == os.path.join(runs["out"], "checkpoints",
                                                             "iter_0000004")


def test_metrics_and_config(runs):
    first = runs["runs"][0]
    row = next(r for r in first["history"] if "train/loss" in r)
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/loss_scale",
                "train/consumed_samples", "perf/tokens_per_s", "perf/tflops_per_device",
                "perf/step_time_s", "mem/rss_gib"):
        assert key in row, key
    assert math.isfinite(row["train/loss"]) and row["perf/tflops_per_device"] > 0
    evals = [r for r in first["history"] if "val/loss" in r]
    assert [r["_step"] for r in evals] == [2, 4]
    assert evals[0]["val/ppl"] == pytest.approx(math.exp(evals[0]["val/loss"]))
    config = first["config"]
    assert config["model"]["hidden_size"] == 64 and config["parallel"]["pp"] == 2
    assert config["train"]["lr"] == 1e-2 and config["mixer"]["name"] == "vanilla"
    assert config["layout"] == {"world_size": 2, "tp": 1, "pp": 2, "vp": 1, "dp": 1}
    assert config["flops_per_token"]["train"] > 0


def test_depth_stats_from_both_stages(runs):
    first = runs["runs"][0]
    rows = [r for r in first["history"] if "depth/weights/entropy/mean" in r]
    assert [r["_step"] for r in rows] == [2, 4]
    for u in range(4):  # layers 0-1 on stage 0, 2-3 on stage 1
        p = fake_weights(u)
        assert rows[0][f"depth/weights/entropy/layer{u}"] == pytest.approx(-(p * np.log(p)).sum())
        assert rows[0][f"depth/weights/max/layer{u}"] == pytest.approx(p.max())
    assert rows[0]["depth/weights/heatmap/_type"] == "image-file"
    assert rows[0]["depth/weights/table/_type"] == "table-file"
    pngs = sorted(glob.glob(os.path.join(runs["out"], "depth_stats", "weights", "*.png")))
    assert [os.path.basename(p) for p in pngs] == \
        ["step_0000002.png", "step_0000004.png", "step_0000006.png"]
    image = np.asarray(Image.open(pngs[0]))
    logged = os.path.join(run_dirs(runs["out"])[0], "files",
                          rows[0]["depth/weights/heatmap/path"])  # what W&B shows: the same
    assert np.array_equal(np.asarray(Image.open(logged).convert("RGB")), image)
    assert image.shape == (4 * 12, 4 * 12, 3)  # 4 layers x 4 sources, 12-px cells
    # layer 0 has one source: the cells right of it are "missing" grey
    assert tuple(image[5, 12 + 5]) == (235, 235, 235)
    assert tuple(image[3 * 12 + 5, 3 * 12 + 5]) != (235, 235, 235)


def test_expert_load_heatmap_from_both_stages(runs):
    """Beside the depth heatmaps, every 2 steps (each segment's own): the experts' shares of
    layers 1 (stage 0) and 3 (stage 1), rows summing to 1, the dense layers grey; the W&B
    image is the PNG."""
    first, resumed = runs["runs"]
    rows = [r for r in first["history"] if "moe/expert_load/heatmap/_type" in r]
    assert [r["_step"] for r in rows] == [2, 4]
    assert [r["_step"] for r in resumed["history"]
            if "moe/expert_load/heatmap/_type" in r] == [6]
    pngs = sorted(glob.glob(os.path.join(runs["out"], "depth_stats", "expert_load", "*.png")))
    assert [os.path.basename(p) for p in pngs] == \
        ["step_0000002.png", "step_0000004.png", "step_0000006.png"]
    image = np.asarray(Image.open(pngs[0]))
    logged = os.path.join(run_dirs(runs["out"])[0], "files",
                          rows[0]["moe/expert_load/heatmap/path"])
    assert np.array_equal(np.asarray(Image.open(logged).convert("RGB")), image)
    assert image.shape == (4 * 12, 4 * 12, 3)  # 4 layers x 4 experts
    for u in (0, 2):  # dense layers
        assert all(tuple(image[u * 12 + 5, e * 12 + 5]) == (235, 235, 235) for e in range(4))
    for u in (1, 3):
        assert all(tuple(image[u * 12 + 5, e * 12 + 5]) != (235, 235, 235) for e in range(4))
    table = os.path.join(run_dirs(runs["out"])[0], "files",
                         rows[0]["moe/expert_load/table/path"])
    data = json.load(open(table))
    assert [row[0] for row in data["data"]] == [1, 3]
    assert all(sum(row[1:]) == pytest.approx(1.0) for row in data["data"])
