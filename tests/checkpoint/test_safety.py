"""Checkpoint safety: damaged checkpoints (overwritten or truncated files) are detected at
load and the previous one used; a missing or unreadable tracker falls back to the newest
complete checkpoint; a checkpoint of another configuration is refused before the model is
built, naming each option; ``train.load_weights_only`` fine-tunes across configurations.
In-process, one rank."""

import logging
import os
import shutil

import pytest
import torch

from depthmix.checkpoint import integrity, resume, store
from depthmix.config.schema import ConfigError
from depthmix.pretrain.callbacks import CheckpointCallback
from depthmix.megatron_ext.model import unwrap
from depthmix.pretrain.trainer import Trainer
from depthmix.testing import SyntheticData, tiny_run

from run_harness import make_run


def _run(tmp_path, mixer="vanilla", **train):
    run = make_run(steps=10)
    if mixer != "vanilla":
        run.mixer = tiny_run(mixer).mixer
    run.output_dir = str(tmp_path)
    run.train.save_dir = str(tmp_path / "ckpt")
    for key, value in train.items():
        setattr(run.train, key, value)
    return run


@pytest.fixture(scope="module")
def pristine(megatron_single, tmp_path_factory):
    """A vanilla run with checkpoints at steps 2 and 3 (trained once per module)."""
    tmp = tmp_path_factory.mktemp("pristine")
    t = Trainer(_run(tmp), data=SyntheticData, callbacks=[])
    root = t.run.train.save_dir
    for step in (1, 2, 3):
        t.train_one_step()
        if step > 1:
            t.save_checkpoint(root, keep_last=0)
    weights = {n: p.detach().clone() for n, p in unwrap(t.model[0]).named_parameters()}
    return root, weights


@pytest.fixture
def saved(pristine, tmp_path):
    """A copy of :func:`pristine`'s checkpoints in ``tmp_path/ckpt`` (tests damage them)."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine[0], root)
    return root, pristine[1]


def _resume(tmp_path, **kwargs) -> Trainer:
    return Trainer(_run(tmp_path, **kwargs), data=SyntheticData, callbacks=[CheckpointCallback()])


def _largest_shard(path: str) -> str:
    files = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp")]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage,mode", [("overwrite", "checksum"), ("truncate", "size")])
def test_damaged_checkpoint_is_detected_and_the_previous_one_used(saved, tmp_path, caplog,
                                                                   damage, mode):
    """Weights overwritten with 0xFF bytes (NaN in fp32, same size: found by the checksum),
    or a shard cut short (found by its size): the run resumes from step 2, not step 3."""
    root, _ = saved
    shard = _largest_shard(store.step_dir(root, 3))
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        if damage == "overwrite":
            f.seek(size // 2)
            f.write(b"\xff" * 4096)
        else:
            f.truncate(size - 100)
    with caplog.at_level(logging.WARNING, logger="depthmix"):
        t = _resume(tmp_path, ckpt_integrity=mode)
    assert t.state.resumed_from == store.step_dir(root, 2) and t.step == 2
    assert f"checkpoint {store.step_dir(root, 3)} is damaged" in caplog.text
    assert os.path.basename(shard) in caplog.text
    assert all(torch.isfinite(p).all() for p in t.model[0].parameters())


def test_manifest_records_every_file(saved):
    root, _ = saved
    meta = store.read_meta(store.step_dir(root, 3))
    on_disk = integrity.list_files(store.step_dir(root, 3), exclude=(store.META,))
    assert sorted(meta["files"]) == on_disk and meta["integrity"] == "checksum"
    assert all(len(entry[integrity.HASH]) == 32 for entry in meta["files"].values())
    assert integrity.verify(store.step_dir(root, 3), meta["files"], "checksum") == []


@pytest.mark.parametrize("tracker", ["deleted", "garbage", "empty"])
def test_missing_or_unreadable_tracker_resumes_from_the_newest_complete(saved, tmp_path,
                                                                         caplog, tracker):
    """Before: a missing tracker silently restarted from step 0 (and overwrote the run)."""
    root, weights = saved
    path = os.path.join(root, store.TRACKER)
    if tracker == "deleted":
        os.remove(path)
    else:
        with open(path, "wb") as f:
            f.write(b"\x00\xffnot a step" if tracker == "garbage" else b"")
    with caplog.at_level(logging.WARNING, logger="depthmix"):
        t = _resume(tmp_path)
    assert t.step == 3 and t.state.resumed_from == store.step_dir(root, 3)
    assert f"using the newest complete checkpoint, {store.step_dir(root, 3)}" in caplog.text
    for name, param in unwrap(t.model[0]).named_parameters():
        assert torch.equal(param, weights[name]), name


def test_unhealthy_newest_checkpoint_is_passed_over(saved, tmp_path, caplog):
    root, _ = saved
    store.set_health(store.step_dir(root, 3), healthy=False)
    assert resume.resume_candidates(root, warn=False) == [store.step_dir(root, 2),
                                                        store.step_dir(root, 3)]
    with caplog.at_level(logging.WARNING, logger="depthmix"):
        t = _resume(tmp_path)
    assert t.state.resumed_from == store.step_dir(root, 2)
    assert "resuming from the newest healthy one" in caplog.text


def test_retention_never_prunes_the_newest_healthy_checkpoint(megatron_single, tmp_path):
    t = Trainer(_run(tmp_path), data=SyntheticData, callbacks=[])
    root = t.run.train.save_dir
    t.train_one_step()
    t.save_checkpoint(root, keep_last=1)
    for _ in range(3):  # three unhealthy saves
        t.train_one_step()
        t.last.nonfinite = True
        t.save_checkpoint(root, keep_last=1)
    assert [s for s, _ in store.list_checkpoints(root)] == [1, 4]
    assert [store.is_healthy(p) for _, p in store.list_checkpoints(root)] == [True, False]


def test_other_configuration_is_refused_before_the_model_is_built(saved, tmp_path,
                                                                  monkeypatch):
    """A vanilla checkpoint and a depth_attn run: before, it resumed silently (exit 0)."""
    from depthmix.pretrain import trainer as trainer_module

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was checked")

    monkeypatch.setattr(trainer_module, "build_model", no_model)
    run = _run(tmp_path, mixer="depth_attn")
    with pytest.raises(ConfigError, match="(?s)mixer.name: checkpoint 'vanilla', this run "
                                          "'depth_attn'.*train.load_weights_only=true"):
        Trainer(run, data=SyntheticData, callbacks=[CheckpointCallback()])
    # through train.load_dir, and one differing option of each kind
    root, _ = saved
    run = _run(tmp_path / "other", load_dir=root, precision="bf16")
    run.model.seq_length = 32
    with pytest.raises(ConfigError) as err:
        resume.preflight_checkpoint(run)
    message = str(err.value)
    assert "model.seq_length: checkpoint 16, this run 32" in message
    assert "train.precision: checkpoint 'fp32', this run 'bf16'" in message
    assert "add train.load_weights_only=true" in message
    assert resume.preflight_checkpoint(_run(tmp_path)) == store.step_dir(root, 3)


def test_load_weights_only_fine_tunes_across_mixers(saved, tmp_path):
    """vanilla -> depth_attn (which adds no parameters): weights load, optimizer, schedule,
    step and data position start fresh; precision may change."""
    root, weights = saved
    t = Trainer(_run(tmp_path / "ft", mixer="depth_attn", load_dir=root,
                     load_weights_only=True, precision="bf16"),
                data=SyntheticData, callbacks=[CheckpointCallback()])
    assert t.state.resumed_from == store.step_dir(root, 3)
    assert t.step == 0 and t.consumed_samples == 0 and t.scheduler.num_steps == 0
    for name, param in unwrap(t.model[0]).named_parameters():
        assert param.dtype == torch.bfloat16, name
        assert torch.equal(param, weights[name].to(torch.bfloat16)), name
    for opt in getattr(t.optimizer, "chained_optimizers", [t.optimizer]):  # no Adam moments
        assert not any("exp_avg" in state for state in opt.optimizer.state.values())
    result = t.train_one_step()
    assert torch.isfinite(torch.tensor(result.loss)) and not result.skipped


def test_load_weights_only_with_other_shapes_names_the_option(saved, tmp_path):
    root, _ = saved
    run = _run(tmp_path / "ft", load_dir=root, load_weights_only=True)
    run.model.ffn_hidden_size = 192
    with pytest.raises(ConfigError, match=r"do not fit this model \(differing options: "
                                          r"model.ffn_hidden_size: checkpoint 160, this run 192"):
        Trainer(run, data=SyntheticData, callbacks=[CheckpointCallback()])
