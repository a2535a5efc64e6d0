"""Small pure functions: the run key (one output directory per job), SLURM node lists and
environment, the PNG writer, depth-statistics summaries."""

import logging
import time

import numpy as np
import pytest
import torch

from depthmix.pretrain import depth_stats, heatmap, launch_env


def test_run_key_is_shared_by_the_ranks_of_one_job():
    assert launch_env.run_key({"DEPTHMIX_RUN_KEY": "abc", "SLURM_JOB_ID": "7"}) == "abc"
    assert launch_env.run_key({"SLURM_JOB_ID": "7"}) == "slurm-7"  # the batch step
    assert launch_env.run_key({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}) == "slurm-7.2"
    assert launch_env.run_key({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "8",
                               "SLURM_ARRAY_TASK_ID": "3"}) == "slurm-8_3"
    assert launch_env.run_key({"TORCHELASTIC_RUN_ID": "xyz", "GROUP_WORLD_SIZE": "2"}) \
        == "torchrun-xyz"
    # torchrun on one node: the agent's start time, identical for all ranks it spawned
    key = launch_env.run_key({"TORCHELASTIC_RUN_ID": "none"})
    assert key == launch_env.run_key({"TORCHELASTIC_RUN_ID": "none"})
    assert key.startswith("local/")
    assert launch_env.run_key({}).startswith("local/" + time.strftime("%Y-%m-%d"))


def test_expand_nodelist():
    assert launch_env.expand_nodelist("node[001-003,007],gpu5") == \
        ["node001", "node002", "node003", "node007", "gpu5"]
    assert launch_env.expand_nodelist("a1") == ["a1"]
    assert launch_env.expand_nodelist("h[9-11]") == ["h9", "h10", "h11"]


def test_master_port_is_derived_from_the_job_id():
    assert launch_env.master_port("4242") == 24242
    assert launch_env.master_port("123456789") == 20000 + 456789 % 20000
    assert 20000 <= launch_env.master_port("12_3") < 40000


def test_distributed_env_from_srun_tasks():
    env = {"SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "4242",
           "SLURM_NTASKS_PER_NODE": "8(x2)"}
    assert launch_env.ensure_distributed_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("9", "16", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("gpu01", "24242")
    assert env["LOCAL_WORLD_SIZE"] == "8"
    assert launch_env.launcher_rank(env) == 9
    torchrun = {"RANK": "3", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    assert not launch_env.ensure_distributed_env(torchrun)  # torchrun already set it
    assert launch_env.launcher_rank(torchrun) == 3
    assert not launch_env.ensure_distributed_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"})


def test_nonzero_ranks_are_quiet(tmp_path):
    root = logging.getLogger()
    handler = logging.FileHandler(tmp_path / "x.log")
    root.addHandler(handler)
    level = root.level
    try:
        launch_env.quiet_nonzero_rank_logging(0)
        assert handler in root.handlers
        launch_env.quiet_nonzero_rank_logging(1)
        assert handler not in root.handlers and root.level == logging.WARNING
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        logging.getLogger("depthmix").setLevel(logging.NOTSET)


def test_png_round_trip():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (7, 5, 3), dtype=np.uint8)
    assert np.array_equal(heatmap.read_png(heatmap.png_bytes(rgb)), rgb)
    grey = rng.integers(0, 256, (3, 9), dtype=np.uint8)
    assert np.array_equal(heatmap.read_png(heatmap.png_bytes(grey)), grey)
    with pytest.raises(ValueError):
        heatmap.png_bytes(np.zeros((2, 2, 4), dtype=np.uint8))


def test_heatmap_colours():
    image = heatmap.render(np.array([[0.0, 1.0], [np.nan, 0.5]]), cell=4)
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
