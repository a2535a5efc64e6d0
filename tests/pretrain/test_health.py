"""Numerical health (``depthmix.pretrain.health``): a non-finite step never reaches the
weights or the optimizer state in any precision; skip / stop / rollback / max in a row;
fp16 stuck at its minimum loss scale; loss spikes; a diverging run keeps a healthy
checkpoint to resume from; ``depthmix-train`` exits 3. In-process, one rank (plus one CLI
run)."""

import functools
import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from depthmix.checkpoint import store
from depthmix.pretrain.callbacks import CheckpointCallback
from depthmix.pretrain.health import NONFINITE_LOSS, Action, HealthGuard, TrainingDiverged
from depthmix.pretrain.trainer import Trainer
from depthmix.testing import SyntheticData

from run_harness import FaultyData, Recorder, make_run, run_cli, spawn, train


@pytest.fixture
def make_trainer(megatron_single, tmp_path):
    def make(data=SyntheticData, callbacks=(), steps=6, **train):
        run = make_run(steps=steps)
        run.output_dir = str(tmp_path)
        run.train.save_dir = str(tmp_path / "ckpt")
        for key, value in train.items():
            setattr(run.train, key, value)
        return Trainer(run, data=data, callbacks=list(callbacks))

    return make


def _state(trainer) -> dict:
    """Every weight and optimizer tensor (the fp16 loss scaler excepted: it must move)."""
    out = {f"param/{i}/{n}": p.detach().clone()
           for i, chunk in enumerate(trainer.model) for n, p in chunk.named_parameters()}

    def walk(prefix, obj):
        if torch.is_tensor(obj):
            out[prefix] = obj.detach().clone()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if k != "grad_scaler":
                    walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for k, v in enumerate(obj):
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (int, float)):
            out[prefix] = obj

    walk("optimizer", trainer.optimizer.state_dict())
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        same = torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key]
        assert same, f"{key} changed"


def _nan_grad(model):
    for chunk in model:
        param = next(chunk.parameters())
        param.main_grad.view(-1)[0] = float("nan")
        return


@pytest.mark.parametrize("precision,fault", [
    ("fp32", "loss"), ("fp32", "grad"), ("bf16", "loss"), ("bf16", "grad"), ("fp16", "loss"),
])
def test_nonfinite_step_leaves_weights_and_optimizer_untouched(make_trainer, precision, fault):
    """Megatron 0.16.1 checks for inf/NaN only under fp16 (found_inf); in fp32/bf16 a NaN
    gradient went through clipping into Adam. Now no precision applies such an update."""
    nan_steps = (3,) if fault == "loss" else ()
    t = make_trainer(data=functools.partial(FaultyData, nan_steps=nan_steps),
                     precision=precision, initial_loss_scale=1024.0)
    for _ in range(2):
        assert not t.train_one_step().skipped
    before = _state(t)
    result = t.train_one_step(after_backward=_nan_grad if fault == "grad" else None)
    assert result.skipped and result.nonfinite and result.nonfinite_steps == 1
    assert math.isfinite(result.loss) == (fault == "grad")
    _assert_same(before, _state(t))
    result = t.train_one_step()
    assert not result.skipped and not result.nonfinite and result.nonfinite_steps == 1
    after = _state(t)
    assert all(not torch.equal(before[k], after[k]) for k in before if k.startswith("param/"))


def test_skipping_a_step_is_the_same_as_never_seeing_its_batch(make_trainer):
    """Skip policy: a run whose step 3 is NaN trains on exactly as a run without that batch
    (same losses, bit for bit: weights, Adam moments and step count, LR schedule untouched)."""
    faulty = Recorder()
    t = make_trainer(data=functools.partial(FaultyData, nan_steps=(3,)), callbacks=[faulty])
    t.train()
    reference = Recorder()
    make_trainer(data=functools.partial(FaultyData, drop_steps=(3,)), callbacks=[reference],
                 exit_after_steps=5).train()  # same schedule (train.steps), one step less
    losses = [s["loss"] for s in faulty.steps]
    assert math.isnan(losses[2]) and t.health.total == 1 and t.step == 6
    assert losses[:2] + losses[3:] == [s["loss"] for s in reference.steps]
    assert [s["lr"] for s in faulty.steps][3:] == [s["lr"] for s in reference.steps][2:]


def test_stop_policy(make_trainer):
    rec = Recorder()
    t = make_trainer(data=functools.partial(FaultyData, nan_steps=(3,)), callbacks=[rec],
                     on_nonfinite="stop")
    with pytest.raises(TrainingDiverged, match=r"step 3: non-finite loss \(train.on_nonfinite"):
        t.train()
    assert t.step == 3 and [s["step"] for s in rec.steps] == [1, 2, 3]


def test_max_nonfinite_steps_in_a_row(make_trainer):
    t = make_trainer(data=functools.partial(FaultyData, nan_steps=(2, 3, 5, 6, 7)),
                     max_nonfinite_steps=3, steps=10)
    with pytest.raises(TrainingDiverged, match=r"step 7: 3 non-finite .*max_nonfinite_steps=3"):
        t.train()
    assert t.health.total == 5  # 2, 3 (then a good step resets the count), 5, 6, 7
    t = make_trainer(data=functools.partial(FaultyData, nan_steps=(2, 3, 5, 6)),
                     max_nonfinite_steps=3)
    t.train()
    assert t.step == 6 and t.health.total == 4


def test_rollback_reloads_the_last_checkpoint_and_skips_the_window(make_trainer):
    """Step 5 is NaN: reload the step-3 checkpoint and continue with the data after the
    window (steps 4-5) that led to it. Identical, bit for bit, to a run that never saw
    that window."""
    rec = Recorder()
    t = make_trainer(data=functools.partial(FaultyData, nan_steps=(5,)),
                     callbacks=[rec, CheckpointCallback()], on_nonfinite="rollback",
                     save_interval=3, steps=7)
    t.train()
    reference = Recorder()
    make_trainer(data=functools.partial(FaultyData, drop_steps=(4, 5)), callbacks=[reference],
                 steps=7, save_dir=t.state.save_dir + "_reference").train()
    assert [s["step"] for s in rec.steps] == [1, 2, 3, 4, 5, 4, 5, 6, 7]
    assert t.health.rollbacks == 1 and t.consumed_samples == (7 + 2) * 8
    kept = rec.steps[:3] + rec.steps[5:]
    for key in ("loss", "grad_norm", "lr", "rng"):
        assert [s[key] for s in kept] == [s[key] for s in reference.steps], key
    assert store.read_meta(store.step_dir(t.state.save_dir, 7))["consumed_train_samples"] == 72


def test_a_nonfinite_step_right_after_a_save_demotes_that_checkpoint(make_trainer):
    """The step after a save is the first to use its weights: a NaN there marks the
    checkpoint unhealthy (retention and rollback then go further back); a finite one
    confirms it."""
    t = make_trainer(data=functools.partial(FaultyData, nan_steps=(5,)),
                     callbacks=[CheckpointCallback()], save_interval=2, keep_last=1, steps=6)
    t.train()
    health = {s: store.read_meta(p)["health"] for s, p in store.list_checkpoints(t.state.save_dir)}
    assert sorted(health) == [2, 6]  # 4 pruned once demoted; 2 kept: newest confirmed
    assert health[2]["healthy"] and health[2]["confirmed"]
    assert health[6]["healthy"] and not health[6]["confirmed"]


def test_rollback_without_a_checkpoint_skips(make_trainer):
    t = make_trainer(data=functools.partial(FaultyData, nan_steps=(2,)), on_nonfinite="rollback")
    t.train()
    assert t.step == 6 and t.health.total == 1 and t.health.rollbacks == 0


def test_fp16_stuck_at_the_minimum_loss_scale_counts_as_nonfinite(make_trainer):
    """Every backward overflows at a scale that cannot go lower: before, every step was
    skipped until the end and the run exited 0. Ordinary overflows are not counted."""
    t = make_trainer(precision="fp16", initial_loss_scale=2.0**40, min_loss_scale=2.0**40,
                     max_nonfinite_steps=3, steps=20)
    with pytest.raises(TrainingDiverged, match="fp16 overflow at the minimum loss scale"):
        t.train()
    assert t.step == 3 and t.health.total == 3
    rec = Recorder()
    t = make_trainer(precision="fp16", initial_loss_scale=2.0**19, loss_scale_window=2,
                     callbacks=[rec], max_nonfinite_steps=1)
    t.train()
    skipped = [s["grad_norm"] is None for s in rec.steps]
    assert any(skipped) and not all(skipped) and t.health.total == 0


def test_loss_spike_zscore():
    cfg = SimpleNamespace(spike_zscore=3.0, spike_window=4, on_spike="skip",
                          on_nonfinite="skip", max_nonfinite_steps=2, min_loss_scale=1.0)
    guard = HealthGuard(cfg)
    steps, verdicts = [0], []

    def step(loss):
        steps[0] += 1
        skipped = guard.check(loss, 1.0)
        result = SimpleNamespace(loss=loss, grad_norm=1.0, skipped=skipped, scale_used=None)
        verdicts.append(guard.observe(steps[0], result))
        return skipped

    assert [step(x) for x in (5.0, 4.9, 5.1, 5.0)] == [None] * 4  # filling the window
    assert [v.action for v in verdicts] == [Action.APPLY] * 4
    assert step(9.0) == "loss spike" and guard.spikes == 1
    assert verdicts[-1].action is Action.SKIP and verdicts[-1].reason == "loss spike"
    assert step(4.0) is None  # lower losses are never spikes
    assert step(9.0) == "loss spike"
    assert verdicts[-1].action is Action.SKIP and not verdicts[-1].nonfinite
    assert step(9.0) == "loss spike" and verdicts[-1].action is Action.STOP  # 2 in a row
    assert "max_nonfinite_steps=2" in verdicts[-1].reason
    log_only = HealthGuard(SimpleNamespace(**{**vars(cfg), "on_spike": "log"}))
    guard, steps[0] = log_only, 0
    assert [step(x) for x in (5.0, 4.9, 5.1, 5.0, 9.0)] == [None] * 5
    assert verdicts[-1].action is Action.APPLY
    assert log_only.spikes == 1 and list(log_only.window)[-1] == 9.0


def test_diverging_run_keeps_a_healthy_checkpoint_to_resume_from(make_trainer, tmp_path):
    """lr=1e20 from a good step-3 checkpoint: step 4 is still finite (its update destroys
    the weights), step 5 onwards NaN. The run skips, then stops after 3 in a row; the
    step-4 checkpoint is demoted by step 5, retention keeps the step-3 one, and resuming
    picks it and continues exactly like the healthy run."""
    straight = Recorder()
    make_trainer(callbacks=[straight, CheckpointCallback()], save_interval=1, keep_last=0,
                 steps=5, save_dir=str(tmp_path / "straight")).train()
    root = tmp_path / "ckpt"
    root.mkdir()
    for step in (2, 3):
        shutil.copytree(store.step_dir(str(tmp_path / "straight"), step),
                        store.step_dir(str(root), step))
    (root / store.TRACKER).write_text("3")

    diverging = Recorder()
    t = make_trainer(callbacks=[diverging, CheckpointCallback()], save_interval=1, keep_last=1,
                     steps=20, lr=1e20, max_nonfinite_steps=3)
    assert t.step == 3
    with pytest.raises(TrainingDiverged):
        t.train()
    assert [math.isfinite(s["loss"]) for s in diverging.steps] == [True, False, False, False]
    assert t.step == 7
    kept = [s for s, _ in store.list_checkpoints(str(root))]
    assert kept == [3, 7]
    assert store.read_meta(store.step_dir(str(root), 3))["health"]["confirmed"]
    assert not store.read_meta(store.step_dir(str(root), 7))["health"]["healthy"]

    resumed = Recorder()
    t = make_trainer(callbacks=[resumed, CheckpointCallback()], steps=5)
    assert t.state.resumed_from == store.step_dir(str(root), 3)
    t.train()
    assert [s["loss"] for s in resumed.steps] == [s["loss"] for s in straight.steps[3:]]


def _two_ranks() -> dict:
    """DP=2 with only DP rank 1's half of step 3 NaN, and PP=2 (the loss lives on the last
    stage): every rank must take the same decision at the same step."""
    import hashlib

    from depthmix.megatron_ext.model import unwrap

    out = {}
    for name, parallel in (("dp2", {}), ("pp2", {"pp": 2})):
        seen = {"steps": [], "weights": {}}

        class Watch(Recorder):
            def post_step(self, trainer, result):
                flat = torch.cat([p.detach().flatten() for chunk in trainer.model
                                  for p in unwrap(chunk).parameters()])
                seen["weights"][trainer.step] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
                seen["steps"].append((result.loss, result.nonfinite, result.skipped))

        data = functools.partial(FaultyData, nan_steps=(3,),
                                 nan_dp_ranks=None if parallel else (1,))
        train(make_run(steps=4, **parallel), [Watch()], data=data)
        out[name] = seen
    return out


@pytest.mark.multiproc
def test_ranks_agree_without_an_extra_collective():
    per_rank = spawn(_two_ranks, 2, timeout=240)
    for name in ("dp2", "pp2"):
        a, b = (r[name] for r in per_rank)
        for x, y in zip(a["steps"], b["steps"]):
            assert x[1:] == y[1:] and (x[0] == y[0] or math.isnan(x[0]) and math.isnan(y[0]))
        assert [s[1:] for s in a["steps"]] == [(False, None)] * 2 + [
            (True, NONFINITE_LOSS), (False, None)], name
        assert math.isnan(a["steps"][2][0]), name
        for rank in (a, b):  # step 3 left every rank's weights alone
            w = rank["weights"]
            assert w[3] == w[2] and w[4] != w[3], name
    assert per_rank[0]["dp2"]["weights"] == per_rank[1]["dp2"]["weights"]  # replicas agree


@pytest.mark.multiproc(at_once=1)
def test_cli_exits_3_when_training_diverges(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(["model=tiny", "logger=none", "train.log_interval=1", "train.eval_interval=0",
                    "train.micro_batch_size=4", "train.global_batch_size=8", "train.steps=50",
                    "data.embedded_documents=300", f"data.cache_dir={tmp_path / 'cache'}",
                    "train.lr=1e20", "train.warmup_fraction=0", "train.max_nonfinite_steps=2",
                    f"output_dir={out}"], cwd=str(tmp_path), timeout=240)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "training diverged at step 3" in proc.stderr
    assert "train.max_nonfinite_steps=2" in proc.stderr
    assert "| nonfinite 2" in proc.stdout
    assert not os.path.exists(out / "checkpoints" / store.TRACKER)  # nothing saved after NaN
