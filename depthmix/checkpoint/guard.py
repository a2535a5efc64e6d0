"""Save safety: one run per save directory, room for the next checkpoint, clean failure of a
save, and no helper process outliving the trainer.

* **Lock.** Rank 0 holds ``<save_dir>/depthmix.lock`` (host, pid, SLURM job id, start
  time) from start-up to exit. A second run on the same directory is refused at start-up
  naming the holder. A lock is stale, and taken over with a warning, when its process is
  gone (same host, pid not alive or reused) or its SLURM job has finished (``squeue``); a
  requeued SLURM job (same job id) takes over its own lock.
* **Room.** At start-up the directory must be writable and able to hold one checkpoint;
  before every save rank 0 estimates its size (the newest checkpoint's size, or before the
  first save the weights + optimizer bytes) and, when the disk is short, first removes the
  checkpoints ``train.keep_last`` would remove after this save anyway (:mod:`.retention`),
  never the newest complete one. A save that still cannot fit fails before writing, naming
  the directory, the bytes needed and the bytes free.
* **Failure.** A save runs inside :func:`saving`: when it raises (ENOSPC, any error in
  ``dist_checkpointing.save``) its ``.tmp_iter_*`` directory is removed, the previous
  checkpoint and tracker are left as they were and :class:`SaveError` says what ran out;
  training stops with a non-zero status.
* **No orphans.** :func:`release_all` releases the locks at exit, and no helper process
  (Megatron's forked checkpoint writers) outlives the trainer: both are process-global
  patches of :mod:`depthmix.runtime.patches` (``LocksReleasedAtExit``, ``ForkedHelpers``),
  installed by the entry points.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from typing import Optional

import torch
import torch.distributed as dist

from depthmix.checkpoint import retention, store
from depthmix.config.schema import ConfigError
from depthmix.planning.memory import state_bytes_per_param
from depthmix.planning.units import fmt_bytes

log = logging.getLogger("depthmix")

LOCK = "depthmix.lock"
MARGIN = 1.05  # checkpoint sizes vary a little (metadata, pickled objects)


class SaveError(RuntimeError):
    """A checkpoint could not be saved; the message says what ran out and what is intact."""


# ---------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------

_held: list = []  # SaveLocks this process holds (released at exit and on abort)


def _create_time(pid: int) -> Optional[float]:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "create_time": _create_time(os.getpid())}


def _slurm_job_running(job_id: str) -> Optional[bool]:
    """True/False from ``squeue``; None when it cannot tell (no squeue, error)."""
    exe = shutil.which("squeue")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-h", "-j", str(job_id), "-o", "%T"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        # squeue exits non-zero for a job id it no longer knows
        return False if "invalid job id" in out.stderr.lower() else None
    states = out.stdout.split()
    return bool(states) and any(s not in ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT")
                                for s in states)


def takeover_reason(holder: dict) -> Optional[str]:
    """Why the lock ``holder`` may be taken over (stale or ours), or None if it is live."""
    me = _me()
    host, pid, job = holder.get("host"), holder.get("pid"), holder.get("job_id")
    if host == me["host"] and pid == me["pid"]:
        return "held by this process"
    if job and job == me["job_id"]:
        return f"held by an earlier run of this SLURM job {job} (requeued)"
    if host == me["host"] and isinstance(pid, int):
        created = _create_time(pid)
        if created is None:
            return f"process {pid} on {host} is gone"
        if holder.get("create_time") and abs(created - holder["create_time"]) > 1.0:
            return f"process {pid} on {host} is gone (its pid was reused)"
        return None
    if job and _slurm_job_running(job) is False:
        return f"SLURM job {job} has finished"
    return None


def describe(holder: dict) -> str:
    parts = [f"host {holder.get('host')}", f"pid {holder.get('pid')}"]
    if holder.get("job_id"):
        parts.append(f"SLURM job {holder['job_id']}")
    parts.append(f"started {holder.get('started')}")
    return ", ".join(parts)


class SaveLock:
    """``<directory>/depthmix.lock``: created exclusively, holds :func:`_me` as JSON."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK)
        self.held = False

    def read(self) -> Optional[dict]:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "SaveLock":
        os.makedirs(self.directory, exist_ok=True)
        text = json.dumps(_me(), indent=2)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.read()
                if holder is None:
                    continue  # released meanwhile
                reason = takeover_reason(holder) if holder else "the lock file is unreadable"
                if reason is None:
                    raise ConfigError(
                        f"train.save_dir={self.directory} is in use by another run "
                        f"({describe(holder)}; lock file {self.path}): stop that run or "
                        "choose another train.save_dir (if that run is surely gone, delete "
                        "the lock file)")
                if reason != "held by this process":
                    log.warning("taking over the lock %s: %s", self.path, reason)
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, self.path)
                break
            with os.fdopen(fd, "w") as f:
                f.write(text)
            break
        else:
            raise ConfigError(f"train.save_dir={self.directory}: could not take {self.path}")
        mine = self.read() or {}
        if mine.get("pid") != os.getpid() or mine.get("host") != socket.gethostname():
            raise ConfigError(f"train.save_dir={self.directory} was locked meanwhile by "
                              f"another run ({describe(mine)}; lock file {self.path})")
        self.held = True
        if self not in _held:
            _held.append(self)
        return self

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self.read() or {}
        if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            try:
                os.unlink(self.path)
            except OSError:
                pass


def release_all() -> None:
    """Release every lock this process holds (exit paths, including an abort)."""
    for lock in list(_held):
        lock.release()
    _held.clear()


# ---------------------------------------------------------------------------------------
# Room for a checkpoint
# ---------------------------------------------------------------------------------------


def check_writable(directory: str) -> None:
    """Create ``directory`` and write, fsync and delete a probe file in it."""
    probe = os.path.join(directory, f".write_probe_{socket.gethostname()}_{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"depthmix")
            f.flush()
            os.fsync(f.fileno())
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"train.save_dir={directory} is not writable: {e.strerror or e}")


def free_bytes(directory: str) -> int:
    return shutil.disk_usage(directory).free


def dir_bytes(path: str) -> int:
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                pass
    return total


def state_bytes(model, run, topo) -> int:
    """Collective: bytes of one checkpoint from the parameter count (before the first save):
    weights and optimizer state per parameter as :func:`depthmix.planning.memory.
    state_bytes_per_param` counts them (all of it: a checkpoint holds every shard), once
    per data-parallel replica group."""
    per_param = state_bytes_per_param(run.train.precision, distributed_optimizer=False, dp=1)
    local = 0
    if topo.dp_rank == 0:
        local = sum(p.numel() for chunk in model for p in chunk.parameters())
    box = torch.tensor([local * int(per_param["weights"] + per_param["optimizer"])],
                       dtype=torch.int64)
    if torch.cuda.is_available():
        box = box.cuda()
    dist.all_reduce(box)
    return int(box.item())


def needed_bytes(root: str, estimate: Optional[int]) -> tuple:
    """(bytes, how it was estimated) for the next checkpoint in ``root``."""
    complete = store.list_checkpoints(root)
    if complete:
        return int(dir_bytes(complete[-1][1]) * MARGIN), f"size of {complete[-1][1]}"
    if estimate:
        return int(estimate * MARGIN), "weights + optimizer state"
    return 0, "unknown"


def make_room(root: str, step: int, keep_last: int, estimate: Optional[int], health: dict,
              dry: bool = False) -> Optional[str]:
    """Rank 0, before saving ``step`` (health mark ``health``): None when it fits, after
    removing what retention removes after this save anyway (:func:`retention.
    prunable_before`; with ``dry`` only counted), else the reason it does not fit."""
    need, how = needed_bytes(root, estimate)
    free = free_bytes(root)
    if free >= need:
        return None
    prunable = retention.prunable_before(root, keep_last, step, health)
    if dry:
        free += sum(dir_bytes(path) for _, path in prunable)
    else:
        for _, path in prunable:
            if free >= need:
                break
            log.warning("only %s free in %s, a checkpoint needs about %s: removing %s now "
                        "(train.keep_last=%d removes it after this save anyway)",
                        fmt_bytes(free), root, fmt_bytes(need), path, keep_last)
            store.remove(path)
            free = free_bytes(root)
    if free >= need:
        return None
    return (f"not enough space to save the checkpoint of step {step} in {root}: it needs about "
            f"{fmt_bytes(need)} ({need} bytes, from the {how}), {fmt_bytes(free)} ({free} "
            f"bytes) are free there (train.keep_last={keep_last}; the newest complete "
            "checkpoint is never removed to make room). Free space, lower train.keep_last or "
            "choose another train.save_dir, then re-run to resume")


def _broadcast(value):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------------------
# Start-up, and around each save
# ---------------------------------------------------------------------------------------


class SaveGuard:
    """What :class:`~depthmix.pretrain.callbacks.CheckpointCallback` holds for a run."""

    def __init__(self, root: str, lock: Optional[SaveLock], estimate: int):
        self.root, self.lock, self.estimate = root, lock, estimate

    @classmethod
    def start(cls, root: str, *, run, model, topo, step: int) -> "SaveGuard":
        """Collective, at start-up: lock, writability, room for one checkpoint. Raises
        :class:`ConfigError` (naming ``train.save_dir``) on every rank when refused."""
        estimate = state_bytes(model, run, topo)
        lock, problem = None, None
        if dist.get_rank() == 0:
            try:
                check_writable(root)
                lock = SaveLock(root).acquire()
                retention.clean_leftovers(root)  # an interrupted (background) write's
                problem = make_room(root, step, run.train.keep_last, estimate,
                                    {"healthy": True, "confirmed": False}, dry=True)
            except (ConfigError, OSError) as e:
                problem = str(e)
        problem = _broadcast(problem)
        if problem:
            if lock is not None:
                lock.release()
            raise ConfigError(problem if problem.startswith("train.save_dir=")
                              else f"train.save_dir={root}: {problem}")
        return cls(root, lock, estimate)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()


def prepare(root: str, step: int, *, keep_last: int, estimate: Optional[int],
            health: dict) -> None:
    """Collective, before writing the checkpoint of ``step``: leftovers are removed and room
    is made (:func:`make_room`); :class:`SaveError` on every rank when it cannot fit."""
    problem = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            retention.clean_leftovers(root)  # they hold space the check must see
            problem = make_room(root, step, keep_last, estimate, health)
        except OSError as e:
            problem = f"cannot prepare {root} for the checkpoint of step {step}: {e}"
    problem = _broadcast(problem)
    if problem:
        log.error("%s", problem)
        raise SaveError(problem)


@contextlib.contextmanager
def failing(root: str, step: int, estimate: Optional[int]):
    """Around writing or publishing the checkpoint of ``step`` (also a background write's
    completion): when it raises, its temporary directory is removed and :class:`SaveError`
    says what ran out and what is intact."""
    tmp = store.tmp_dir(root, step)
    try:
        yield
    except BaseException as exc:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit, SaveError)):
            raise  # (torch's CheckpointException is a BaseException: handled below)
        try:
            previous = store.latest_checkpoint(root)
            free = fmt_bytes(free_bytes(root))
        except Exception:  # noqa: BLE001 - the message must not fail
            previous, free = None, "unknown"
        need, _ = needed_bytes(root, estimate)
        message = (f"saving the checkpoint of step {step} to {root} failed: "
                   f"{_what_ran_out(exc)}. Removed the partial {tmp}; {free} free there "
                   f"now, a checkpoint needs about {fmt_bytes(need)}. "
                   + (f"The previous checkpoint {previous} is intact; free space (or "
                      "lower train.keep_last) and re-run to resume from it."
                      if previous else "There is no earlier checkpoint."))
        log.error("%s", message)
        raise SaveError(message) from exc


@contextlib.contextmanager
def saving(root: str, step: int, *, keep_last: int, estimate: Optional[int], health: dict):
    """Collective, around writing and publishing the checkpoint of ``step``:
    :func:`prepare`, then :func:`failing`."""
    prepare(root, step, keep_last=keep_last, estimate=estimate, health=health)
    with failing(root, step, estimate):
        yield


def _what_ran_out(exc: BaseException) -> str:
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        failures = getattr(e, "failures", None)  # torch's CheckpointException: rank -> error
        if isinstance(failures, dict):
            text += " ".join(map(repr, failures.values()))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return "no space left on device (ENOSPC)"
        if isinstance(e, OSError) and e.errno == errno.EDQUOT:
            return "disk quota exceeded (EDQUOT)"
        e = e.__cause__ or e.__context__
    if any(s in text for s in ("No space left", "Errno 28", "ENOSPC", "unexpected pos",
                               "file write failed")):
        return "no space left on device (ENOSPC)"
    if "Disk quota exceeded" in text or "Errno 122" in text:
        return "disk quota exceeded (EDQUOT)"
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}"
