"""Run ``depthmix-train`` as real processes (torchrun, the SLURM scripts) and watch their
output: a reader thread collects lines, tests wait for a pattern, then signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

from run_harness import PYTHON, REPO, env_for_subprocess

FAKE_SLURM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime", "fake_slurm")
STEP = re.compile(r"^step\s+(\d+)/")

# small and quick: the tiny preset on 8-sample steps, loss every step, no W&B, no eval
TINY = ["model=tiny", "logger=none", "train.log_interval=1", "train.eval_interval=0",
        "train.micro_batch_size=4", "train.global_batch_size=8", "train.steps=500",
        "data.embedded_documents=600"]


class Proc:
    def __init__(self, args, cwd, env, timeout=300, **popen):
        self.lines = []
        self.deadline = time.monotonic() + timeout
        self.p = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, bufsize=1, **popen)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def steps(self) -> list:
        return [int(m.group(1)) for m in map(STEP.match, self.lines) if m]

    def wait_for(self, predicate, what: str):
        while time.monotonic() < self.deadline:
            if predicate(self):
                return
            if self.p.poll() is not None:
                self._reader.join(5)
                if predicate(self):
                    return
                raise AssertionError(
                    f"exited ({self.p.returncode}) before {what}:\n{self.text[-4000:]}")
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"timed out waiting for {what}:\n{self.text[-4000:]}")

    def finish(self) -> int:
        try:
            self.p.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"timed out:\n{self.text[-4000:]}")
        self._reader.join(10)
        return self.p.returncode

    def kill(self):
        """Kill the whole process tree we started (by pid, never by name)."""
        import psutil

        try:
            procs = [psutil.Process(self.p.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in reversed(procs):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def sigint_at_default() -> None:
    """``preexec_fn``: the child starts with SIGINT at its default disposition, as from a
    terminal (a process started in the background of a non-interactive shell, e.g. a test
    runner's, inherits SIGINT ignored, and bash cannot trap a signal ignored on entry)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_quiet_signal_stop(proc: Proc, signame: str) -> int:
    """The console of a launcher stopped by ``signame``: one "received" line (the logging
    rank's), no torchrun traceback or death-signal warnings, and the closing summary as its
    last lines. Returns the step the run stopped at (its last step line)."""
    text = proc.text
    assert "Traceback" not in text and "death signal" not in text, text[-3000:]
    assert text.count("received SIG") == 1 and f"received {signame}:" in text, text[-3000:]
    m = re.search(rf"preemption \({signame}\) at step (\d+)", text)
    assert m, text[-3000:]
    stopped = int(m.group(1))
    assert proc.steps()[-1] == stopped, text[-3000:]
    ending = [line.split(" ")[0] for line in proc.lines[-4:]]
    assert ending == ["run", "outputs:", "last", "resume:"], text[-3000:]
    assert proc.lines[-4].startswith(f"run preempted ({signame}) at step {stopped}/"), \
        text[-3000:]
    return stopped


def base_env(tmp: str, cache: str, **extra) -> dict:
    env = env_for_subprocess(DEPTHMIX_CACHE_DIR=cache, **extra)
    env["PATH"] = os.pathsep.join([os.path.dirname(PYTHON), env.get("PATH", "")])
    return env


def slurm_env(tmp: str, cache: str, job_id: str = "4242", nproc: int = 2, **extra) -> dict:
    """A single-node SLURM job as the batch script sees it, with fake srun/scontrol/scancel
    on PATH (they record their calls in ``<tmp>/fake/calls``)."""
    fake = os.path.join(tmp, "fake")
    os.makedirs(fake, exist_ok=True)
    env = base_env(tmp, cache, **extra)
    env["PATH"] = os.pathsep.join([FAKE_SLURM, env["PATH"]])
    env.update(SLURM_JOB_ID=job_id, SLURM_NNODES="1", SLURM_JOB_NODELIST="node001",
               SLURM_SUBMIT_DIR=REPO, SLURM_JOB_NAME="depthmix",
               DEPTHMIX_NPROC_PER_NODE=str(nproc), DEPTHMIX_PYTHON=PYTHON,
               FAKE_SLURM_DIR=fake)
    return env


def calls(tmp: str) -> list:
    path = os.path.join(tmp, "fake", "calls")
    return open(path).read().splitlines() if os.path.exists(path) else []


def torchrun(nproc: int, args, cwd, env, timeout=300) -> Proc:
    return Proc([PYTHON, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}", "-m", "depthmix.cli.train", *args],
                cwd=cwd, env=env, timeout=timeout)


def rank_processes(root_pid: int) -> dict:
    """{rank: psutil.Process} of the training ranks below ``root_pid`` (not the processes a
    rank forked, e.g. background checkpoint writers, which share its command and env)."""
    import psutil

    found = {}
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            env = proc.environ()
            if "depthmix.cli.train" in " ".join(proc.cmdline()) and "RANK" in env \
                    and "TORCHELASTIC_RUN_ID" in env:
                found[proc.pid] = (int(env["RANK"]), proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    out = {}
    for rank, proc in found.values():
        try:
            if proc.ppid() not in found:
                out[rank] = proc
        except psutil.NoSuchProcess:
            pass
    return out
