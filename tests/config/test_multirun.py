"""Hydra multirun's configs: the sweep files and the SLURM launcher compose. (A multirun's
points in separate output directories with separate checkpoints and W&B runs:
``tests/cli/test_sweep.py``.)"""

import pytest


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
