"""The launch environment (``depthmix.runtime.env``): the run key (one output directory per
job), SLURM node lists, the distributed environment from srun's tasks, quiet non-zero
ranks."""

import logging
import os
import time

import pytest

from depthmix.runtime import env as launch_env

from cli_runs import FAKE_SLURM


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


def test_master_port_is_derived_from_the_job_id():
    assert launch_env.master_port("4242") == 24242
    assert launch_env.master_port("123456789") == 20000 + 456789 % 20000
    assert 20000 <= launch_env.master_port("12_3") < 40000


@pytest.mark.multiproc(at_once=1)
def test_distributed_env_from_srun_tasks(tmp_path, monkeypatch):
    """MASTER_ADDR is the first host SLURM's ``scontrol show hostnames`` names for the job's
    node list (the fake one records the call and answers with FAKE_SLURM_HOSTNAMES)."""
    monkeypatch.setenv("PATH", os.pathsep.join([FAKE_SLURM, os.environ["PATH"]]))
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_SLURM_HOSTNAMES", "gpu01 gpu02")
    env = {"SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "4242",
           "SLURM_NTASKS_PER_NODE": "8(x2)"}
    assert launch_env.ensure_distributed_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("9", "16", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("gpu01", "24242")
    assert (tmp_path / "calls").read_text().splitlines() == ["scontrol show hostnames gpu[01-02]"]
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
