"""Hydra multirun: two Depth-Attention strides run locally (basic launcher) into separate output
directories with separate checkpoints and W&B runs. Sweep and launcher configs compose."""

import os

import pytest
import yaml

from cli_runs import base_env
from run_harness import run_cli
from wandb_files import read_run, run_dirs


@pytest.mark.multiproc(at_once=1)
@pytest.mark.slow
def test_multirun_over_two_strides(tmp_path):
    tmp, cache = str(tmp_path), str(tmp_path / "cache")
    env = base_env(tmp, cache)
    out = run_cli(["-m", "mixer=depth_attn", "mixer.stride=1,2", "model=tiny", "train.steps=2",
                   "train.log_interval=1", "train.eval_interval=0", "train.micro_batch_size=4",
                   "train.global_batch_size=8", "data.embedded_documents=600",
                   "logger=wandb_offline"], cwd=tmp, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sweeps = os.listdir(os.path.join(tmp, "multirun", "local"))
    assert len(sweeps) == 1
    root = os.path.join(tmp, "multirun", "local", sweeps[0])
    jobs = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
                  and not d.startswith("."))
    # <job number>_<overrides>, e.g. 0_data.embedded_documents=600,...,mixer.stride=1,...
    assert len(jobs) == 2 and jobs[0].startswith("0_") and jobs[1].startswith("1_"), jobs
    assert "mixer.stride=1," in jobs[0] and "mixer.stride=2," in jobs[1], jobs
    ids = []
    for job, stride in zip(jobs, (1, 2)):
        job_dir = os.path.join(root, job)
        with open(os.path.join(job_dir, ".hydra", "config.yaml")) as f:
            assert yaml.safe_load(f)["mixer"]["stride"] == stride
        assert os.path.isdir(os.path.join(job_dir, "checkpoints", "iter_0000002"))
        (run_dir,) = run_dirs(job_dir)
        run = read_run(run_dir)
        assert run["config"]["mixer"]["stride"] == stride
        assert run["config"]["output_dir"] == job_dir
        assert [r["_step"] for r in run["history"] if "train/loss" in r] == [1, 2]
        ids.append(run["id"])
    assert ids[0] != ids[1]


def _compose(*overrides):
    from hydra import compose, initialize_config_module

    from depthmix.config.store import register_configs
    from depthmix.runtime.env import register_resolvers

    register_configs()
    register_resolvers()
    with initialize_config_module("depthmix.configs", version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_lr_sweep_file():
    cfg = _compose("sweep=lr")
    assert cfg.hydra.sweeper.params["train.lr"] == "1e-3,3e-3"


@pytest.mark.parametrize("sweep,mixer,key,values", [
    ("depth_attn_stride", "depth_attn", "mixer.stride", "1,6,12,24"),
    ("attnres_num_blocks", "attnres_block", "mixer.num_blocks", "2,4,8,16"),
])
def test_mixer_sweep_files(sweep, mixer, key, values):
    cfg = _compose(f"sweep={sweep}")
    assert cfg.mixer.name == mixer
    assert cfg.hydra.sweeper.params[key] == values


def test_slurm_launcher_config():
    cfg = _compose("launcher=slurm", "hydra.launcher.partition=gpu")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("hydra_submitit_launcher.submitit_launcher.SlurmLauncher")
    assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.nodes) == (8, 8, 1)
    assert launcher.partition == "gpu" and launcher.signal_delay_s == 300
    assert launcher.max_num_timeout == 20
