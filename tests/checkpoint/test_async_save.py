"""Checkpoints written in the background (``train.async_save``): the same losses and weights
as synchronous saves (2 ranks, PP=2); a full disk during a background write keeps the
previous checkpoint and says so. The full lane: ``kill -9`` of a torchrun job while a write
is held leaves no process and resumes from the previous checkpoint; SIGTERM while a write
is pending exits 0 with that checkpoint and a final one complete. On a GPU (``gpu``): the
writer forked from a process whose CUDA is initialised stays off the GPU."""

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
@pytest.mark.full
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


# ---------------------------------------------------------------------------------------
# On a GPU (tools/gpu_bench.py runs the gpu tests)
# ---------------------------------------------------------------------------------------


def _children() -> list:
    """Processes forked by this one (Linux)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return pids


def _gpu_pids():
    """Processes nvidia-smi lists on the GPUs, or None where it cannot tell."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(x) for x in out.split() if x.strip().isdigit()]


@pytest.mark.gpu
def test_a_writer_forked_from_a_cuda_process_stays_off_the_gpu(tmp_path, monkeypatch):
    """On a GPU (bf16, the 1.5B widths at 2 layers, checkpoints of about 1 GB): A trains 6
    steps with background saves every 3; B, a fresh trainer, resumes from A's step-3
    checkpoint: its steps 4-6 and final weights are A's bit for bit. While A's step-3 write
    is held (``DEPTHMIX_CKPT_WRITER_DELAY``), the writer Megatron forked from this process,
    whose CUDA is initialised, exists and is not a GPU process (where nvidia-smi lists this
    process at all: in a container it may show other pids)."""
    import torch

    from depthmix.config.load import compose_run
    from depthmix.megatron_ext.model import unwrap
    from depthmix.pretrain.callbacks.base import Callback
    from depthmix.pretrain.parallelize import destroy_model_parallel

    probe = {}

    class Record(Callback):
        def __init__(self):
            self.losses = {}

        def post_step(self, trainer, result):
            self.losses[trainer.step] = float(result.loss).hex()
            if trainer.step == 3 and "writers" not in probe:  # after the save's fork
                probe.update(writers=[p for p in _children() if p != os.getpid()],
                             gpu_pids=_gpu_pids())

    def train(name, *overrides):
        run = compose_run(
            "model=1p5b", "model.num_layers=2", "model.seq_length=1024", "model.vocab_size=8192",
            "train.micro_batch_size=2", "train.global_batch_size=2", "train.precision=bf16",
            "mixer=vanilla", "logger=none", "train.compile=false", "train.steps=6",
            "train.eval_interval=0", "train.log_interval=1", "train.keep_last=0",
            f"output_dir={tmp_path / name}", *overrides)
        record = Record()
        trainer = Trainer(run, data=SyntheticData, callbacks=[CheckpointCallback(), record])
        try:
            trainer.train()
        finally:
            trainer.close()
        weights = {k: v.detach().to("cpu", copy=True)
                   for k, v in unwrap(trainer.model[0]).state_dict().items()
                   if isinstance(v, torch.Tensor)}
        del trainer
        destroy_model_parallel()
        torch.cuda.empty_cache()
        return record.losses, weights

    monkeypatch.setenv(WRITER_DELAY_ENV, "1.0")
    a, weights_a = train("A", "train.save_interval=3", "train.async_save=true",
                         f"train.save_dir={tmp_path / 'A_ckpt'}")
    monkeypatch.delenv(WRITER_DELAY_ENV)
    b, weights_b = train("B", f"train.load_dir={store.step_dir(str(tmp_path / 'A_ckpt'), 3)}",
                         f"train.save_dir={tmp_path / 'B_ckpt'}")
    same = [b.get(s) for s in (4, 5, 6)] == [a[s] for s in (4, 5, 6)] and all(
        torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    if not same:  # is it the checkpoint, or are two uninterrupted runs not equal either?
        c, weights_c = train("C", "train.save_interval=0")
        deterministic = c == a and all(torch.equal(weights_a[k], weights_c[k]) for k in weights_a)
        pytest.fail(f"resumed run differs from the uninterrupted one (two uninterrupted runs "
                    f"equal: {deterministic}): A {a}, B {b}")
    assert probe["writers"], "no background writer was forked"
    if probe["gpu_pids"] and os.getpid() in probe["gpu_pids"]:
        assert not set(probe["writers"]) & set(probe["gpu_pids"]), probe
