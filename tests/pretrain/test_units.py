"""Small pure functions: the run key (one output directory per job), SLURM node lists and
environment, the PNG writer, depth-statistics summaries."""

import logging
import time

import numpy as np
import pytest
import torch

from depthmix.pretrain.callbacks import depth_stats
from depthmix.runtime import env as launch_env

from png_files import read_png


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


def _fake_trainer(logging_rank: bool):
    import types

    from depthmix.testing import tiny_run

    run = tiny_run()
    run.train.log_interval, run.train.steps = 2, 10
    from depthmix.planning.flops import ThroughputMeter

    trainer = types.SimpleNamespace(
        run=run, config=None, step=0, meter=ThroughputMeter(6e9, 10.0, 1000, world_size=2),
        topo=types.SimpleNamespace(world_size=2, is_logging_rank=logging_rank))
    return trainer


def _step(trainer, callbacks):
    import types

    from depthmix.pretrain.trainer import Trainer

    trainer.step += 1
    trainer.meter.add(0.25)
    result = types.SimpleNamespace(loss=2.5, lr=1e-3, grad_norm=0.75, loss_scale=1.0,
                                   skipped=None, seconds=0.25, nonfinite_steps=0, perf=None,
                                   experts=None)
    if Trainer.is_log_step(trainer):
        result.perf = trainer.meter.read()
    for cb in callbacks:
        cb.post_step(trainer, result)


def test_console_line_fields_and_quiet_ranks():
    from depthmix.pretrain.callbacks import ConsoleLogger

    for logging_rank in (True, False):
        lines = []
        trainer = _fake_trainer(logging_rank)
        console = ConsoleLogger(printer=lines.append)
        for _ in range(4):
            _step(trainer, [console])
        if not logging_rank:
            assert lines == []
            continue
        assert len(lines) == 3  # step 1, then every log_interval=2 steps
        line = lines[-1]
        # 1000 tokens / 0.25 s = 4000 tok/s; x 6 GFLOP / 2 devices = 12 TFLOP/s; / 10 = 120%
        for part in ("step      4/10", "loss 2.5000", "lr 1.000e-03", "grad 0.750", "scale 1",
                     "4,000 tok/s", "12.00 TFLOP/s", "MFU 120.0%", "rss ", "0.250 s/step"):
            assert part in line, (part, line)


def test_progress_bar_carries_the_log_lines(capsys):
    from depthmix.pretrain.callbacks import ConsoleLogger, ProgressBar

    trainer = _fake_trainer(True)
    bar, console = ProgressBar(force=True), ConsoleLogger()
    bar.pre_train(trainer)
    for _ in range(2):
        _step(trainer, [console, bar])
    assert bar.bar.n == 2
    bar.close(trainer)
    out = capsys.readouterr()
    assert "step      2/10" in out.out and "step" in out.err  # line above, bar on stderr


def test_preemption_flag_and_submitit_handover(megatron_single, monkeypatch):
    """In-process, one rank: a signal only sets the flag; the step's all-reduce turns it into
    a stop; under submitit its own handler runs at close (after the save), not before."""
    import os
    import signal
    import types

    from depthmix.pretrain.callbacks import PreemptionCallback

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    handed_over = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    signal.signal(signal.SIGUSR2, lambda signum, frame: handed_over.append(signum))
    stops = []
    trainer = types.SimpleNamespace(step=7, request_stop=stops.append,
                                    topo=types.SimpleNamespace(is_logging_rank=True))
    cb = PreemptionCallback()
    try:
        cb.setup(trainer)
        cb.post_step(trainer, None)
        assert stops == []  # no signal yet
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handed_over == []  # submitit's handler did not run in the signal handler
        cb.post_step(trainer, None)
        assert stops == ["preempted (SIGUSR2)"]
        cb.post_train(trainer)
        assert handed_over == []
        cb.close(trainer)
        assert handed_over == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGTERM) == previous[signal.SIGTERM]  # restored
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
