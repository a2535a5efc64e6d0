"""SIGTERM to one rank of a running 2-process torchrun training (PP=2, gloo): both ranks
stop after the same step, save a complete checkpoint of it and exit 0, and the ranks agree
on one output directory. The full lane: re-running with the resume command the summary
prints resumes from that step; SIGTERM to ``launch/local.sh`` during evaluation stops
within one eval batch and exits 0, and so does Ctrl-C to it (in one process:
``tests/pretrain/test_signals.py``). A launcher's signal stop ends its console with the
closing summary: no torchrun traceback, one "received" line."""

import os
import re
import shlex
import signal
import time

import pytest

from depthmix.checkpoint.store import latest_checkpoint, read_meta, step_dir

from cli_runs import (TINY, Proc, assert_quiet_signal_stop, base_env, rank_processes,
                      sigint_at_default, torchrun)
from run_harness import PYTHON, REPO

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("preempt"))
    cache = str(tmp_path_factory.mktemp("cache"))
    env = base_env(tmp, cache)
    args = [*TINY, "parallel=pp2"]
    first = torchrun(2, args, tmp, env, timeout=300)
    try:
        first.wait_for(lambda p: any(s >= 3 for s in p.steps()), "step 3")
        ranks = rank_processes(first.p.pid)
        assert sorted(ranks) == [0, 1], ranks
        # rank 0 is not the logging rank (that is the last pipeline stage, rank 1): the
        # flag must travel through the all-reduce for rank 1 to stop and report it
        ranks[0].send_signal(signal.SIGTERM)
        code = first.finish()
    finally:
        first.kill()
    runs = os.listdir(os.path.join(tmp, "outputs", "local"))
    return {"tmp": tmp, "cache": cache, "env": env, "args": args, "first": first,
            "code": code, "runs": runs}


def test_sigterm_saves_the_current_step_and_exits_zero(preempted):
    first, tmp = preempted["first"], preempted["tmp"]
    assert preempted["code"] == 0, first.text[-3000:]
    m = re.search(r"preemption \(SIGTERM\) at step (\d+)", first.text)
    assert m, first.text[-3000:]
    stopped = int(m.group(1))
    assert first.steps()[-1] == stopped < 500  # nothing ran after the step it was on
    assert len(preempted["runs"]) == 1, preempted["runs"]  # every rank used one directory
    root = os.path.join(tmp, "outputs", "local", preempted["runs"][0], "tiny_vanilla",
                        "checkpoints")
    assert latest_checkpoint(root) == step_dir(root, stopped)
    meta = read_meta(step_dir(root, stopped))
    assert meta["step"] == stopped and meta["consumed_train_samples"] == 8 * stopped
    assert meta["layout"]["pp"] == 2


@pytest.mark.full
def test_rerun_resumes_from_the_preemption_checkpoint(preempted):
    """With the command the closing summary prints (no environment variable)."""
    first, tmp = preempted["first"], preempted["tmp"]
    stopped = first.steps()[-1]
    resume = [line for line in first.lines if line.startswith("resume: ")]
    assert len(resume) == 1, first.text[-3000:]
    words = shlex.split(resume[0][len("resume: "):])
    assert words[:3] == ["python", "-m", "torch.distributed.run"], words
    args = words[words.index("depthmix.cli.train") + 1:]
    assert args == [*preempted["args"], f"run.name=local/{preempted['runs'][0]}/tiny_vanilla"]
    second = torchrun(2, [*args, "train.exit_after_steps=2"], tmp, preempted["env"],
                      timeout=300)
    try:
        code = second.finish()
    finally:
        second.kill()
    assert code == 0, second.text[-3000:]
    assert f"at step {stopped}" in second.text and "resumed from" in second.text
    assert second.steps() == [stopped + 1, stopped + 2]
    assert os.listdir(os.path.join(tmp, "outputs", "local")) == preempted["runs"]
    run_dir = os.path.join(tmp, "outputs", "local", preempted["runs"][0], "tiny_vanilla")
    root = os.path.join(run_dir, "checkpoints")
    assert latest_checkpoint(root) == step_dir(root, stopped + 2)
    # .hydra is written by rank 0 only (rank 1 runs with hydra.output_subdir=null)
    assert sorted(os.listdir(os.path.join(run_dir, ".hydra"))) == \
        ["config.yaml", "hydra.yaml", "overrides.yaml"]


LOCAL_SH = os.path.join(REPO, "launch", "local.sh")


@pytest.mark.full
def test_launcher_sigterm_during_eval_saves_within_one_eval_batch(tmp_path):
    """launch/local.sh with 2 ranks (PP=2), SIGTERM to the script while both ranks are in a
    300-batch evaluation: torchrun forwards it, the ranks agree to stop after the same eval
    batch, save the step the evaluation belongs to, and the script exits 0 (torchrun alone
    exits 1 after any signal it handled), its console ending with the closing summary;
    torchrun's own messages are in the run directory's torchrun.log."""
    tmp, cache = str(tmp_path), str(tmp_path / "cache")
    env = base_env(tmp, cache, NPROC_PER_NODE=2, DEPTHMIX_PYTHON=PYTHON,
                   DEPTHMIX_RUN_KEY="local/eval-sigterm")
    args = [a for a in TINY if not a.startswith("train.eval_interval")]
    args += ["parallel=pp2", "train.eval_interval=3", "train.eval_iters=300"]
    job = Proc(["bash", LOCAL_SH, *args], cwd=tmp, env=env, timeout=300)
    try:
        job.wait_for(lambda p: 3 in p.steps(), "step 3 (the evaluation starts after it)")
        time.sleep(1.0)
        job.p.send_signal(signal.SIGTERM)
        code = job.finish()
    finally:
        job.kill()
    assert code == 0, job.text[-3000:]
    m = re.search(r"preemption \(SIGTERM\) at step 3 \(in evaluation, after eval batch "
                  r"(\d+)/300\)", job.text)
    assert m, job.text[-3000:]
    assert int(m.group(1)) < 300 and job.steps()[-1] == 3
    assert assert_quiet_signal_stop(job, "SIGTERM") == 3
    run_dir = os.path.join(tmp, "outputs", "local", "eval-sigterm", "tiny_vanilla")
    root = os.path.join(run_dir, "checkpoints")
    assert latest_checkpoint(root) == step_dir(root, 3)
    with open(os.path.join(run_dir, "torchrun.log")) as f:
        assert "Received 15 death signal, shutting down workers" in f.read()


@pytest.mark.full
def test_launcher_ctrl_c_saves_and_ends_with_the_summary(tmp_path):
    """launch/local.sh with 2 ranks (PP=2), stopped by Ctrl-C (SIGINT to the script, at its
    default disposition as under a terminal; torchrun forwards it): both ranks save the step
    they are on and the script exits 0, its console ending with the closing summary."""
    tmp, cache = str(tmp_path), str(tmp_path / "cache")
    env = base_env(tmp, cache, NPROC_PER_NODE=2, DEPTHMIX_PYTHON=PYTHON,
                   DEPTHMIX_RUN_KEY="local/stopped")
    job = Proc(["bash", LOCAL_SH, *TINY, "parallel=pp2"], cwd=tmp, env=env, timeout=300,
               preexec_fn=sigint_at_default)
    try:
        job.wait_for(lambda p: any(s >= 2 for s in p.steps()), "step 2")
        job.p.send_signal(signal.SIGINT)
        code = job.finish()
    finally:
        job.kill()
    assert code == 0, job.text[-3000:]
    stopped = assert_quiet_signal_stop(job, "SIGINT")
    run_dir = os.path.join(tmp, "outputs", "local", "stopped", "tiny_vanilla")
    root = os.path.join(run_dir, "checkpoints")
    assert latest_checkpoint(root) == step_dir(root, stopped)
    with open(os.path.join(run_dir, "torchrun.log")) as f:
        assert "Received 2 death signal" in f.read()
