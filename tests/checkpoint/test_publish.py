"""Write-then-publish: a crash while saving never loses or corrupts the last good checkpoint;
leftovers are cleaned; keep-last pruning; clear errors for bad trackers and load dirs.
In-process, one rank."""

import json
import os

import pytest

from depthmix.checkpoint import distributed, store
from depthmix.config.schema import ConfigError
from depthmix.pretrain.callbacks import CheckpointCallback
from depthmix.pretrain.trainer import Trainer
from depthmix.testing import SyntheticData

from run_harness import make_run


@pytest.fixture
def trainer_factory(megatron_single, tmp_path):
    made = []

    def make(callbacks=(), **parallel):
        run = make_run(**parallel)
        run.train.save_dir = str(tmp_path / "ckpt")
        run.output_dir = str(tmp_path)
        trainer = Trainer(run, data=SyntheticData, callbacks=list(callbacks))
        made.append(trainer)
        return trainer

    yield make


def test_crash_while_writing_keeps_the_previous_checkpoint(trainer_factory, monkeypatch):
    t = trainer_factory()
    root = t.run.train.save_dir
    for _ in range(2):
        t.train_one_step()
    t.save_checkpoint(root)
    t.train_one_step()

    real_save = distributed.dist_checkpointing.save

    def dies_after_writing(state, path, **kwargs):
        real_save(state, path, **kwargs)
        raise RuntimeError("node lost power")

    monkeypatch.setattr(distributed.dist_checkpointing, "save", dies_after_writing)
    with pytest.raises(RuntimeError, match="node lost power"):
        t.save_checkpoint(root)
    monkeypatch.undo()
    assert store.latest_checkpoint(root) == store.step_dir(root, 2)
    assert not os.path.exists(store.step_dir(root, 3))
    assert not os.path.exists(os.path.join(root, ".tmp_iter_0000003"))  # removed on failure

    resumed = trainer_factory([CheckpointCallback()])
    assert resumed.step == 2 and resumed.state.resumed_from == store.step_dir(root, 2)
    resumed.train_one_step()
    resumed.save_checkpoint(root)  # cleans the leftovers
    assert store.latest_checkpoint(root) == store.step_dir(root, 3)
    assert not [n for n in os.listdir(root) if n.startswith((".tmp", ".trash"))]


def test_crash_before_the_tracker_update(trainer_factory, monkeypatch):
    """Published directory, old tracker: the tracker still names a complete checkpoint."""
    t = trainer_factory()
    root = t.run.train.save_dir
    t.train_one_step()
    t.save_checkpoint(root)
    t.train_one_step()
    real = store._write_atomic

    def dies_on_tracker(path, text):
        if path.endswith(store.TRACKER):
            raise RuntimeError("killed")
        real(path, text)

    monkeypatch.setattr(store, "_write_atomic", dies_on_tracker)
    with pytest.raises(RuntimeError):
        t.save_checkpoint(root)
    monkeypatch.undo()
    assert store.latest_checkpoint(root) == store.step_dir(root, 1)
    assert store.is_complete(store.step_dir(root, 2))


def test_keep_last(trainer_factory):
    t = trainer_factory()
    root = t.run.train.save_dir
    for _ in range(4):
        t.train_one_step()
        t.save_checkpoint(root, keep_last=2)
    assert [s for s, _ in store.list_checkpoints(root)] == [3, 4]
    assert store.latest_checkpoint(root) == store.step_dir(root, 4)


def test_bad_trackers_and_load_dirs(tmp_path, trainer_factory):
    root = tmp_path / "broken"
    root.mkdir()
    (root / store.TRACKER).write_text("banana")
    with pytest.raises(RuntimeError, match="corrupt"):
        store.latest_checkpoint(str(root))
    (root / store.TRACKER).write_text("7")
    with pytest.raises(RuntimeError, match="missing or incomplete"):
        store.latest_checkpoint(str(root))
    done = root / "iter_0000005"  # a complete older one: used instead, with a warning
    done.mkdir()
    (done / store.META).write_text("{}")
    assert store.latest_checkpoint(str(root)) == str(done)
    assert store.latest_checkpoint(str(tmp_path / "nothing-here")) is None

    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    t = trainer_factory()
    t.run.train.load_dir = str(run_dir)
    with pytest.raises(ConfigError, match="train.load_dir=.* holds no checkpoint"):
        t.resume()


def test_own_checkpoints_win_over_load_dir(trainer_factory, tmp_path):
    """A job started from train.load_dir that was requeued after saving continues from its
    own checkpoint, not from load_dir again."""
    t = trainer_factory()
    t.train_one_step()
    t.save_checkpoint(str(tmp_path / "pretrained"))
    for _ in range(2):
        t.train_one_step()
    t.save_checkpoint(t.run.train.save_dir)  # this run's own progress, step 3
    t.run.train.load_dir = str(tmp_path / "pretrained")
    t.resume()
    assert t.state.resumed_from == store.step_dir(t.run.train.save_dir, 3) and t.step == 3


def test_dp_reshardable_optimizer_state_cannot_change_tp(trainer_factory, tmp_path):
    t = trainer_factory(distributed_optimizer=True)
    fake = tmp_path / "iter_0000005"
    fake.mkdir()
    meta = {"step": 5, "layout": {"tp": 2, "pp": 1, "vp": 1, "dp": 1,
                                  "distributed_optimizer": True},
            "optim_format": "dp_reshardable"}
    (fake / store.META).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="ckpt_optim_format=fully_reshardable"):
        t.load_checkpoint(str(fake))


def test_resume_with_the_real_data_pipeline_is_exact(megatron_single, tmp_path):
    """build_data(..., consumed_train_samples) from the checkpoint continues the sample
    order exactly (embedded corpus, GPTDataset)."""
    from run_harness import Recorder

    def run_config(**train):
        run = make_run()
        run.model.vocab_size = 512
        run.data.cache_dir = str(tmp_path / "cache")
        run.data.embedded_documents, run.data.embedded_vocab_size = 300, 512
        run.output_dir = str(tmp_path)
        for key, value in train.items():
            setattr(run.train, key, value)
        return run

    straight = Recorder()
    root = str(tmp_path / "real")
    Trainer(run_config(save_dir=root, save_interval=2, keep_last=0, steps=4),
            callbacks=[straight, CheckpointCallback()]).train()
    resumed = Recorder()
    t = Trainer(run_config(load_dir=store.step_dir(root, 2), save_dir=root + "_b", steps=4),
                callbacks=[resumed, CheckpointCallback()])
    assert t.step == 2 and t.consumed_samples == 16
    t.train()
    assert [s["loss"] for s in resumed.steps] == [s["loss"] for s in straight.steps[2:]]
    assert len({s["loss"] for s in straight.steps}) == 4
