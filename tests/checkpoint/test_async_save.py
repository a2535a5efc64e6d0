"""Checkpoints written in the background (``train.async_save``): the same losses and weights
as synchronous saves (2 ranks, PP=2); a full disk during a background write keeps the
previous checkpoint and says so; ``kill -9`` of a torchrun job while a write is held leaves
no process and resumes from the previous checkpoint; SIGTERM while a write is pending exits
0 with that checkpoint and a final one complete."""

import errno
import os
import re
import signal
import time

import psutil
import pytest

from depthmix.checkpoint import store
from depthmix.checkpoint.background import WRITER_DELAY_ENV
from depthmix.checkpoint.guard import SaveError
from depthmix.pretrain.callbacks import CheckpointCallback
from depthmix.pretrain.trainer import Trainer
from depthmix.testing import SyntheticData

from cli_runs import TINY, base_env, rank_processes, torchrun
from run_harness import make_run, spawn, train


def _leftovers(root):
    return [n for n in os.listdir(root) if n.startswith((".tmp", ".trash"))]


def _shards(path):
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".distcp"):
            with open(os.path.join(path, name), "rb") as f:
                out[name] = f.read()
    return out


def _sync_and_async(tmp):
    results = {}
    for background in (False, True):
        run = make_run(steps=6, pp=2)
        run.output_dir = os.path.join(tmp, str(background))
        run.train.save_dir = os.path.join(run.output_dir, "ckpt")
        run.train.save_interval, run.train.async_save = 2, background
        saver = CheckpointCallback()
        steps, _ = train(run, callbacks=[saver])
        results[background] = {"losses": [s["loss"] for s in steps],
                               "in_background": saver.background is not None}
    return results


@pytest.mark.multiproc
def test_async_saves_change_nothing_at_pp2(tmp_path):
    per_rank = spawn(_sync_and_async, 2, (str(tmp_path),), timeout=300)
    for rank in per_rank:
        sync, background = rank[False], rank[True]
        assert background["in_background"] and not sync["in_background"]
        assert background["losses"] == sync["losses"] and len(set(sync["losses"])) == 6
    for step in (4, 6):  # every rank's shards, bit for bit
        a = _shards(store.step_dir(str(tmp_path / "False" / "ckpt"), step))
        b = _shards(store.step_dir(str(tmp_path / "True" / "ckpt"), step))
        assert len(a) == 4 and a == b, step  # two files per rank


def test_full_disk_during_a_background_write(megatron_single, tmp_path, monkeypatch):
    """The forked writer hits ENOSPC: the poll that finds it raises SaveError naming it (the
    run stops, as after a failed synchronous save), the partial directory is removed and
    the previous checkpoint and tracker are untouched."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    run = make_run(steps=6)
    run.output_dir, run.train.save_dir = str(tmp_path), str(tmp_path / "ckpt")
    saver = CheckpointCallback()
    t = Trainer(run, data=SyntheticData, callbacks=[saver])
    root = run.train.save_dir
    try:
        assert saver.background is not None
        t.train_one_step()
        saver.save(t)
        assert saver.background.wait() == store.step_dir(root, 1)

        def disk_full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(filesystem_async, "_write_item", disk_full)  # forked writer too
        t.train_one_step()
        saver.save(t)
        monkeypatch.undo()
        t.train_one_step()  # training went on while the write was in the background
        with pytest.raises(SaveError, match="no space left on device") as err:
            saver.background.wait()
        assert f"previous checkpoint {store.step_dir(root, 1)} is intact" in str(err.value)
        assert not _leftovers(root) and not os.path.exists(store.step_dir(root, 2))
        assert store.latest_checkpoint(root) == store.step_dir(root, 1)
        assert saver.background.pending is None
    finally:
        t.close()


def _job(tmp, steps, delay=0):
    env = base_env(tmp, os.path.join(tmp, "cache"), **{WRITER_DELAY_ENV: delay})
    args = [*TINY, "parallel=pp2", f"train.steps={steps}", "train.save_interval=2",
            f"train.save_dir={tmp}/ckpt", f"output_dir={tmp}/out"]
    return torchrun(2, args, tmp, env, timeout=240)


def _tree(pid):
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _alive(procs, within=5.0):
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.multiproc
@pytest.mark.slow
def test_kill_9_and_sigterm_while_a_background_write_is_pending(tmp_path):
    tmp = str(tmp_path)
    root = os.path.join(tmp, "ckpt")
    first = _job(tmp, steps=4)
    assert first.finish() == 0, first.text[-3000:]
    assert store.latest_checkpoint(root) == store.step_dir(root, 4)

    # held writers: step 6 is being written when step 8's save comes due and waits for it
    held = _job(tmp, steps=12, delay=120)
    try:
        held.wait_for(lambda p: "waiting for the background write of the checkpoint of "
                                "step 6" in p.text, "the second save waiting for the first")
        tree = _tree(held.p.pid)
        assert os.path.isdir(store.tmp_dir(root, 6)) and len(tree) >= 5  # writers forked
        for proc in tree:  # the whole job at once, torchrun included
            proc.send_signal(signal.SIGKILL)
        assert not _alive(tree)
    finally:
        held.kill()
    assert store.latest_checkpoint(root) == store.step_dir(root, 4)
    stale = store.tmp_dir(root, 6)  # marked: the re-run's own write of step 6 has the name
    open(os.path.join(stale, "killed-write"), "w").close()

    # re-run: resumes from step 4 (the interrupted write is removed at start); SIGTERM to
    # the ranks while step 6 is written: they wait for it, save the final step, exit 0
    last = _job(tmp, steps=500, delay=3)
    try:
        last.wait_for(lambda p: any(s >= 5 for s in p.steps()), "step 5")
        assert not os.path.exists(os.path.join(stale, "killed-write"))
        assert set(_leftovers(root)) <= {os.path.basename(stale)}  # at most its own write
        last.wait_for(lambda p: "checkpoint of step 6: writing in the background" in p.text,
                      "the background write of step 6")
        for proc in rank_processes(last.p.pid).values():
            proc.send_signal(signal.SIGTERM)
        assert last.finish() == 0, last.text[-3000:]
    finally:
        last.kill()
    assert "resumed from" in last.text and "iter_0000004" in last.text
    stopped = int(re.search(r"preemption \(SIGTERM\) at step (\d+)", last.text).group(1))
    assert stopped >= 6 and store.is_complete(store.step_dir(root, 6))
    assert store.latest_checkpoint(root) == store.step_dir(root, stopped)
    assert store.read_meta(store.step_dir(root, stopped))["step"] == stopped
    assert not _leftovers(root)
