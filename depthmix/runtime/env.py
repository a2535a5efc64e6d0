"""What the process learns from its launcher (torchrun, srun, submitit) before training.

* ``run.name`` fixes the output directory (``outputs/<name>``, :func:`named_dir`); without
  it :func:`run_key` names the output directory so that every rank of one job agrees on it
  (and a requeued SLURM job finds its own checkpoints again): ``$DEPTHMIX_RUN_KEY`` if set
  (the ``launch/`` scripts set it), ``slurm-<job id>[.<step id>]`` under SLURM,
  ``torchrun-<rdzv id>`` for a multi-node torchrun, else ``local/<time>`` where the time
  is the torchrun agent's start time (shared by the ranks it spawned) or now.
* :func:`ensure_distributed_env` fills torch.distributed's ``RANK``/``WORLD_SIZE``/...
  from SLURM's variables when the tasks were started by ``srun`` or submitit directly
  (no torchrun), e.g. Hydra multirun on SLURM.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import subprocess
import time
from typing import Mapping, Optional

import psutil

RESOLVER = "dm.run_key"
NAMED = "dm.named"
TIME_FORMAT = "%Y-%m-%d_%H-%M-%S"


def _stamp(seconds: Optional[float] = None) -> str:
    when = datetime.datetime.fromtimestamp(seconds) if seconds else datetime.datetime.now()
    return when.strftime(TIME_FORMAT)


def _agent_start_time() -> Optional[float]:
    """Start time of the torchrun agent that spawned this rank (same for all its ranks)."""
    try:
        return psutil.Process(os.getppid()).create_time()
    except psutil.Error:  # the agent is gone, or not ours to read
        return None


def run_key(env: Mapping[str, str] = os.environ) -> str:
    """The part of the output directory that identifies this job (see module docstring)."""
    if env.get("DEPTHMIX_RUN_KEY"):
        return env["DEPTHMIX_RUN_KEY"]
    job = env.get("SLURM_JOB_ID")
    if job:
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        step = env.get("SLURM_STEP_ID")
        return f"slurm-{job}" + (f".{step}" if step not in (None, "") else "")
    rdzv = env.get("TORCHELASTIC_RUN_ID", "none")
    if rdzv not in ("", "none") and int(env.get("GROUP_WORLD_SIZE", "1")) > 1:
        return f"torchrun-{rdzv}"
    if "TORCHELASTIC_RUN_ID" in env:
        start = _agent_start_time()
        if start:
            return f"local/{_stamp(start)}"
    return f"local/{_stamp()}"


def named_dir(root: str, name: Optional[str], unnamed: str) -> str:
    """``${dm.named:outputs,${run.name},<unnamed>}``: ``outputs/<run.name>`` when the run
    has a name (the same directory every time: re-running resumes), else
    ``outputs/<unnamed>`` (the run key's fresh directory)."""
    if name is not None and str(name).strip("/ "):
        return f"{root}/{str(name).strip('/ ')}"
    return f"{root}/{unnamed}"


def register_resolvers() -> None:
    """``${dm.run_key:}`` and ``${dm.named:...}`` for ``configs/config.yaml``. The run key
    is cached, so a Hydra sweep computes it once on the submitting side and its jobs
    (submitit pickles the cache) reuse it."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda: run_key(), use_cache=True)
    if not OmegaConf.has_resolver(NAMED):
        OmegaConf.register_new_resolver(NAMED, named_dir)


def launcher_rank(env: Mapping[str, str] = os.environ) -> int:
    """Global rank as far as the launcher tells (before torch.distributed exists)."""
    if "RANK" in env:
        return int(env["RANK"])
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    return 0


def hostnames(nodelist: str) -> list:
    """The hosts of a SLURM node list (``node[001-003],gpu5``), as SLURM itself expands it
    (``scontrol show hostnames``; an empty list: the job's own)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", *([nodelist] if nodelist else [])],
                             capture_output=True, text=True, check=True)
    except FileNotFoundError:
        raise RuntimeError(f"SLURM node list {nodelist!r}: scontrol is not on PATH to expand "
                           "it; set MASTER_ADDR") from None
    return out.stdout.split()


def master_port(job_id: str) -> int:
    """A rendezvous port derived from the job id (same on every node, varies per job)."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 20000 + int(digits[-6:]) % 20000


def ensure_distributed_env(env=os.environ) -> bool:
    """Under ``srun``/submitit without torchrun, set RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT from SLURM's variables. Returns whether it did."""
    if "RANK" in env or int(env.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_PROCID" not in env:
        return False
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        env["MASTER_ADDR"] = hostnames(nodelist)[0]
    env.setdefault("MASTER_PORT", str(master_port(env.get("SLURM_JOB_ID", "0"))))
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    return True


def quiet_nonzero_rank_logging(rank: int) -> None:
    """Ranks other than 0: warnings and errors only, and no log file of their own; console
    lines (:func:`depthmix.runtime.log.say`) still show (the loss rank may be one of them)."""
    from depthmix.runtime.log import CONSOLE

    if rank == 0:
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()
    root.setLevel(logging.WARNING)
    logging.getLogger("depthmix").setLevel(logging.WARNING)
    logging.getLogger(CONSOLE).setLevel(logging.INFO)


def free_port() -> int:
    """A TCP port that is free on this host now: the rendezvous port of a world started
    without a launcher (a plain single process, the tests' spawned ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_threads(env: Mapping[str, str] = os.environ) -> int:
    """Threads per process for torch's CPU work: ``OMP_NUM_THREADS`` when set, else the CPUs
    this process may run on shared among the ranks of this node (``LOCAL_WORLD_SIZE``;
    torch's default of every core per process oversubscribes a node running several ranks
    or a loaded machine)."""
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cpus = os.cpu_count() or 1
    local = re.match(r"\d*", env.get("LOCAL_WORLD_SIZE")
                     or env.get("SLURM_NTASKS_PER_NODE") or "1").group()  # SLURM: "8(x2)"
    return max(1, cpus // max(1, int(local or 1)))


def set_torch_threads() -> int:
    import torch

    threads = torch_threads()
    torch.set_num_threads(threads)
    return threads


_job_start: Optional[float] = None


def mark_job_start() -> None:
    """A Hydra job begins: its closing "wall" counts from here, not from the process start
    (a local multirun runs its jobs one after another in one process)."""
    global _job_start
    _job_start = time.time()


def job_start() -> Optional[float]:
    return _job_start

