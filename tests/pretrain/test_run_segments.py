"""A run in several segments, as ``depthmix-train`` processes: stopped after 2 of 3 steps
and resumed with ``run.name``, its closing summary prints one ``wandb sync`` command with
both offline segments; the same command run again on the finished run says so and exits 0
in seconds without opening another W&B run. At PP=2 (the logging rank is the last stage,
not rank 0; the full lane), ``train.log`` holds every step line and the closing summary."""

import os
import re
import shlex
import time

import pytest

from cli_runs import TINY, base_env, torchrun
from run_harness import run_cli
from wandb_files import run_dirs


SHORT = [a for a in TINY if not a.startswith("train.steps=")] + ["train.steps=3"]


@pytest.mark.multiproc(at_once=1)
def test_resumed_run_syncs_every_segment_and_a_finished_run_stops_at_once(tmp_path):
    tmp = str(tmp_path)
    env = base_env(tmp, os.path.join(tmp, "cache"))
    command = [*SHORT, "logger=wandb_offline", "run.name=seg"]
    first = run_cli([*command, "train.exit_after_steps=2"], cwd=tmp, env=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    finished = run_cli(command, cwd=tmp, env=env)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    assert "run finished at step 3/3" in finished.stdout
    out = os.path.join(tmp, "outputs", "seg")
    segments = run_dirs(out)
    assert len(segments) == 2
    (sync,) = [l for l in finished.stdout.splitlines() if l.startswith("W&B (offline): ")]
    listed = shlex.split(sync.split(": ", 1)[1])
    assert listed[:2] == ["wandb", "sync"]
    assert [os.path.join(tmp, p) for p in listed[2:]] == segments

    started = time.monotonic()
    again = run_cli(command, cwd=tmp, env=env)
    seconds = time.monotonic() - started
    assert again.returncode == 0, again.stderr[-2000:]
    assert "run already finished at step 3/3" in again.stdout, again.stdout
    assert seconds < 15, seconds
    assert run_dirs(out) == segments  # no new W&B run


@pytest.mark.multiproc
@pytest.mark.full
def test_train_log_holds_the_last_stages_lines_at_pp2(tmp_path):
    tmp = str(tmp_path)
    env = base_env(tmp, os.path.join(tmp, "cache"))
    proc = torchrun(2, [*SHORT, "parallel=pp2", "run.name=pp"], cwd=tmp, env=env)
    assert proc.finish() == 0, proc.text[-3000:]
    with open(os.path.join(tmp, "outputs", "pp", "train.log")) as f:
        log = f.read()
    steps = [int(m) for m in re.findall(r"\] - step\s+(\d+)/3 ", log)]
    assert steps == [1, 2, 3], log[-3000:]
    assert "run finished at step 3/3" in log and "last checkpoint: " in log
