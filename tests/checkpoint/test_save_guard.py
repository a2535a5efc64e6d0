"""Save safety, in one process where possible: a full disk (a real tmpfs when this test may
mount one, and a writer that hits ENOSPC), the save_dir lock against a second real process,
kill -9 and a double Ctrl-C leaving no helper process behind. (A signal's save:
``tests/pretrain/test_signals.py``.)"""

import errno
import os
import signal
import subprocess
import time
import uuid

import pytest

from depthmix.checkpoint import guard, store
from depthmix.checkpoint.guard import SaveError, SaveLock
from depthmix.config.schema import ConfigError
from depthmix.pretrain.callbacks import CheckpointCallback

from cli_runs import Proc
from run_harness import PYTHON, env_for_subprocess, trainer_saving_to

HERE = os.path.dirname(os.path.abspath(__file__))


def _trainer(save_dir, callbacks=None, **train):
    return trainer_saving_to(save_dir, [CheckpointCallback()] if callbacks is None else callbacks,
                             **train)


def _leftovers(root):
    return [n for n in os.listdir(root) if n.startswith((".tmp", ".trash"))]


# ---------------------------------------------------------------------------------------
# Full disk
# ---------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 6.5 MiB tmpfs (room for two checkpoints of the test model, not three)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6656k", "tmpfs", str(mount)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    yield str(mount)
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.multiproc(at_once=1)
def test_retention_makes_room_on_a_small_disk(megatron_single, small_disk):
    """keep_last=2 needs room for three checkpoints while saving the third: the one retention
    would remove next is removed first, so the save fits (it used to fail here every time)."""
    root = os.path.join(small_disk, "ckpt")
    t = _trainer(root, save_interval=1, keep_last=2, steps=4)
    t.train()
    t.close()
    assert [s for s, _ in store.list_checkpoints(root)] == [3, 4]
    assert store.latest_checkpoint(root) == store.step_dir(root, 4)
    assert not _leftovers(root)
    assert not os.path.exists(os.path.join(root, guard.LOCK))  # released on close


@pytest.mark.multiproc(at_once=1)
def test_full_disk_fails_clearly_keeps_the_previous_checkpoint(megatron_single, small_disk):
    root = os.path.join(small_disk, "ckpt")
    t = _trainer(root, keep_last=1)
    t.train_one_step()
    t.save_checkpoint(root, keep_last=1)
    size = guard.dir_bytes(store.step_dir(root, 1))
    free = guard.free_bytes(root)
    with open(os.path.join(small_disk, "filler"), "wb") as f:  # leave half a checkpoint
        f.write(b"\0" * (free - size // 2))
    t.train_one_step()
    with pytest.raises(SaveError) as err:
        t.save_checkpoint(root, keep_last=1)
    message = str(err.value)
    assert "not enough space" in message and root in message
    assert "bytes) are free" in message and "bytes, from the size of" in message
    assert not _leftovers(root)
    assert store.latest_checkpoint(root) == store.step_dir(root, 1)  # the newest is kept
    t.close()

    # the re-run is refused at start-up (before any work), naming the directory ...
    with pytest.raises(ConfigError, match=r"train.save_dir=.*not enough space"):
        _trainer(root, keep_last=1)
    # ... and resumes from the intact checkpoint once there is room
    os.unlink(os.path.join(small_disk, "filler"))
    again = _trainer(root, keep_last=1, steps=3)
    assert again.step == 1 and again.state.resumed_from == store.step_dir(root, 1)
    again.train()
    again.close()
    assert store.latest_checkpoint(root) == store.step_dir(root, 3)


def test_enospc_while_writing(megatron_single, tmp_path, monkeypatch):
    """A writer that hits ENOSPC (in Megatron's forked writer process): the save fails naming
    what ran out, its temporary directory is gone, the previous checkpoint and the tracker are
    untouched, and a re-run resumes from it and saves again."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    root = str(tmp_path / "ckpt")
    t = _trainer(root)
    t.train_one_step()
    t.save_checkpoint(root)
    tracker = open(os.path.join(root, store.TRACKER)).read()
    t.train_one_step()

    def disk_full(*args, **kwargs):  # writing one item to its open shard file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(filesystem_async, "_write_item", disk_full)
    with pytest.raises(SaveError, match="no space left on device") as err:
        t.save_checkpoint(root)
    monkeypatch.undo()
    assert f"previous checkpoint {store.step_dir(root, 1)} is intact" in str(err.value)
    assert not _leftovers(root) and not os.path.exists(store.step_dir(root, 2))
    assert open(os.path.join(root, store.TRACKER)).read() == tracker
    t.close()

    again = _trainer(root)
    assert again.state.resumed_from == store.step_dir(root, 1)
    again.train_one_step()
    again.save_checkpoint(root)
    assert store.latest_checkpoint(root) == store.step_dir(root, 2)
    again.close()


def test_unwritable_save_dir_is_refused_at_start_up(megatron_single, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"train.save_dir.*(not writable|cannot be created)"):
        _trainer(str(blocker / "ckpt"))


# ---------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------

HOLD = ("import sys, time; from depthmix.checkpoint.guard import SaveLock; "
        "SaveLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)")


@pytest.mark.multiproc(at_once=1)
def test_second_run_on_a_locked_save_dir_is_refused(megatron_single, tmp_path):
    root = str(tmp_path / "ckpt")
    holder = Proc([PYTHON, "-c", HOLD, root], cwd=str(tmp_path), env=env_for_subprocess(),
                  timeout=120)
    try:
        holder.wait_for(lambda p: "locked" in p.lines, "the lock")
        with pytest.raises(ConfigError) as err:
            _trainer(root)
        message = str(err.value)
        assert f"train.save_dir={root} is in use by another run" in message
        assert f"pid {holder.p.pid}" in message and os.uname().nodename in message
        holder.p.send_signal(signal.SIGKILL)  # the holder dies without releasing
        holder.p.wait(30)
    finally:
        holder.kill()
    t = _trainer(root)  # a stale lock (its process is gone) is taken over
    assert SaveLock(root).read()["pid"] == os.getpid()
    t.close()
    assert not os.path.exists(os.path.join(root, guard.LOCK))


def _foreign_lock(root, job_id):
    os.makedirs(root, exist_ok=True)
    lock = SaveLock(root)
    with open(lock.path, "w") as f:
        f.write(f'{{"host": "node-{uuid.uuid4().hex[:6]}", "pid": 4321, "job_id": "{job_id}",'
                ' "started": "2026-01-01T00:00:00"}')
    return lock


@pytest.mark.multiproc(at_once=1)
def test_slurm_lock_takeover(tmp_path, monkeypatch):
    """Another host's lock: taken over by a requeue of the same SLURM job, or when squeue
    says its job has finished; refused while that job runs."""
    root = str(tmp_path / "ckpt")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    _foreign_lock(root, "777")
    SaveLock(root).acquire().release()  # our own job, requeued

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    squeue.write_text("#!/bin/sh\necho RUNNING\n")
    squeue.chmod(0o755)
    _foreign_lock(root, "555")
    with pytest.raises(ConfigError, match="SLURM job 555"):
        SaveLock(root).acquire()
    squeue.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\n"
                      "exit 1\n")
    lock = SaveLock(root).acquire()
    assert lock.read()["job_id"] == "777"
    lock.release()


# ---------------------------------------------------------------------------------------
# Processes and signals from outside
# ---------------------------------------------------------------------------------------


def _start_child(tmp_path):
    """save_child.py with 60 s writers, stopped in its first save (helpers alive)."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    child = Proc([PYTHON, os.path.join(HERE, "save_child.py"), run_dir, "60"], cwd=HERE,
                 env=env_for_subprocess(PYTHONPATH=os.pathsep.join(
                     [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE])),
                 timeout=180)
    child.wait_for(lambda p: len([n for n in os.listdir(run_dir)
                                  if n.startswith("writer_")]) >= 2, "the writers")
    import psutil

    tree = psutil.Process(child.p.pid).children(recursive=True)
    return child, run_dir, tree


def _survivors(procs, within=5.0):
    import psutil

    deadline = time.monotonic() + within
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.multiproc
def test_kill_9_leaves_no_process_behind(tmp_path):
    child, run_dir, tree = _start_child(tmp_path)
    try:
        writers = {int(n[len("writer_"):]) for n in os.listdir(run_dir) if n.startswith("writer_")}
        assert writers <= {p.pid for p in tree}, (writers, tree)  # forked by the trainer
        child.p.send_signal(signal.SIGKILL)
        child.p.wait(30)
        alive = _survivors(tree)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
    finally:
        child.kill()
        for p in tree:
            if p.is_running():
                p.kill()


@pytest.mark.multiproc
def test_second_ctrl_c_aborts_at_once(tmp_path):
    """First SIGINT: save and stop requested; a second one aborts now, exit 130, in the middle
    of the save; its helpers die with it and the save_dir lock is released."""
    child, run_dir, tree = _start_child(tmp_path)
    try:
        child.p.send_signal(signal.SIGINT)
        child.wait_for(lambda p: "received SIGINT" in p.text, "the first SIGINT")
        child.p.send_signal(signal.SIGINT)
        assert child.p.wait(10) == 130, child.text[-2000:]
        assert not _survivors(tree)
        assert not os.path.exists(os.path.join(run_dir, "checkpoints", guard.LOCK))
    finally:
        child.kill()
        for p in tree:
            if p.is_running():
                p.kill()
