"""``depthmix-eval``: one checkpoint, trained at TP2 x PP2, evaluated at every layout.

A tiny Depth-Attention model trains 2 steps at TP=2 x PP=2 (sequence parallel) in a group
of 4 gloo processes, which then evaluates it at TP2xPP2, TP2xDP2, PP2xDP2, PP2xVP2xDP2 and
DP4; ``depthmix-eval`` runs it again as a single process (TP1). The losses agree within
1e-5 (relative) and equal a direct computation: the checkpoint loaded into one process
(``load_model``) and a plain forward over the same windows. Bad input is refused before
any compute, naming the option.
"""

import json
import math
import os
import subprocess

import numpy as np
import pytest
import torch

from depthmix.config.schema import ConfigError
from depthmix.evaluate.job import compose_job

from run_harness import PYTHON, env_for_subprocess, make_run, spawn, train

SIZES = {"a": 300, "b": 170}
"""Tokens per dataset: 299 / 16 -> 18 full windows and a partial one; 169 -> 10 and one."""

LAYOUTS = {  # evaluated in the 4-process group
    "tp2_pp2": ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"],
    "tp2_dp2": ["parallel.tp=2"],
    "pp2_dp2": ["parallel.pp=2"],
    "pp2_vp2_dp2": ["parallel.pp=2", "parallel.vp=2"],
    "dp4": [],
}


def write_tokens(prefix: str, n: int, seed: int, high: int = 128) -> None:
    """A Megatron ``.bin/.idx`` of ``n`` random tokens in documents of 1-40 tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    g = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    while n:
        k = min(n, int(g.integers(1, 41)))
        builder.add_document(torch.from_numpy(g.integers(0, high, k)), [k])
        n -= k
    builder.finalize(f"{prefix}.idx")


def datasets_option(tmp: str, names=("a", "b")) -> str:
    return "eval.datasets={" + ", ".join(f"{n}: {os.path.join(tmp, n)}" for n in names) + "}"


def _train_then_evaluate(tmp: str) -> dict:
    """One rank of the 4-process group."""
    from depthmix.evaluate.job import run_job
    from depthmix.pretrain.callbacks import CheckpointCallback
    from depthmix.testing import tiny_run

    run = make_run(steps=2, tp=2, pp=2, sequence_parallel=True)
    run.mixer = tiny_run("depth_attn").mixer
    run.train.save_dir = os.path.join(tmp, "ckpt")
    train(run, [CheckpointCallback()])
    out = {}
    for name, options in LAYOUTS.items():
        job = compose_job(f"eval.checkpoint={tmp}/ckpt", datasets_option(tmp),
                          "eval.batch_size=2", f"eval.output={tmp}/eval_{name}.json", *options,
                          world_size=4)
        out[name] = run_job(job)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("eval"))
    for i, (name, n) in enumerate(SIZES.items()):
        write_tokens(os.path.join(tmp, name), n, seed=i)
    write_tokens(os.path.join(tmp, "small"), 16, seed=7)  # one token short of a window
    write_tokens(os.path.join(tmp, "other_vocab"), 100, seed=8, high=1000)
    layouts = spawn(_train_then_evaluate, 4, (tmp,), timeout=400)[0]
    return {"tmp": tmp, "ckpt": os.path.join(tmp, "ckpt"), "layouts": layouts}


@pytest.fixture(scope="module")
def single(trained):
    """``depthmix-eval`` as one process (TP1), with W&B offline."""
    tmp = trained["tmp"]
    proc = subprocess.run(
        [PYTHON, "-m", "depthmix.cli.eval", f"eval.checkpoint={trained['ckpt']}",
         datasets_option(tmp), "eval.batch_size=3", "mixer=depth_attn", "logger=wandb_offline",
         f"logger.dir={tmp}/wandb_eval"],
        cwd=tmp, env=env_for_subprocess(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = os.path.join(trained["ckpt"], "iter_0000002", "eval", "eval.json")
    with open(path) as f:
        return {"results": json.load(f), "stdout": proc.stdout, "tmp": tmp}


def _direct_losses(ckpt: str, prefixes: dict, seq_length: int) -> dict:
    """Mean NLL per dataset by a plain forward of the model loaded into this process, over
    windows cut here from the raw ``.bin`` (the partial last window forwarded as it is)."""
    from depthmix.inference.load import load_model

    loaded = load_model(ckpt)
    out = {}
    for name, prefix in prefixes.items():
        stream = torch.from_numpy(np.fromfile(f"{prefix}.bin", dtype=np.uint16).astype(np.int64))
        total, tokens = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(stream) - 1, seq_length):
                piece = stream[start:start + seq_length + 1]
                logits = loaded.model(piece[None, :-1])[0].double()  # [s, vocab]
                nll = -torch.log_softmax(logits, -1).gather(-1, piece[1:, None])
                total += float(nll.sum())
                tokens += len(piece) - 1
        out[name] = (total / tokens, tokens)
    return out


@pytest.mark.multiproc
def test_same_loss_at_every_layout(trained, single):
    ref = single["results"]
    assert ref["layout"] == {"world_size": 1, "tp": 1, "pp": 1, "vp": 1, "dp": 1}
    for name, res in trained["layouts"].items():
        assert res["layout"]["world_size"] == 4, name
        for ds in (*SIZES, "pooled"):
            got = res["pooled"] if ds == "pooled" else res["datasets"][ds]
            want = ref["pooled"] if ds == "pooled" else ref["datasets"][ds]
            assert got["tokens"] == want["tokens"] and got["windows"] == want["windows"]
            assert math.isclose(got["loss"], want["loss"], rel_tol=1e-5), (name, ds, got, want)
    assert trained["layouts"]["pp2_vp2_dp2"]["layout"]["vp"] == 2


@pytest.mark.multiproc
def test_perplexity_equals_a_direct_computation(trained, single):
    res = single["results"]
    assert res["step"] == 2 and res["mixer"] == "depth_attn"
    s = res["seq_length"]
    direct = _direct_losses(trained["ckpt"], {n: os.path.join(trained["tmp"], n) for n in SIZES},
                            s)
    for name, n in SIZES.items():
        loss, tokens = direct[name]
        got = res["datasets"][name]
        assert got["tokens"] == tokens == n - 1  # every token but the first, once
        assert got["windows"] == -(-(n - 1) // s)
        assert math.isclose(got["loss"], loss, rel_tol=1e-5), (name, got["loss"], loss)
        assert math.isclose(got["ppl"], math.exp(loss), rel_tol=1e-5)
    a, b = res["datasets"]["a"], res["datasets"]["b"]
    pooled = (a["loss"] * a["tokens"] + b["loss"] * b["tokens"]) / (a["tokens"] + b["tokens"])
    assert math.isclose(res["pooled"]["loss"], pooled, rel_tol=1e-12)


@pytest.mark.multiproc
def test_console_table_and_wandb(single):
    from wandb_files import read_run, run_dirs

    lines = single["stdout"].splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["dataset", "tokens"])
    rows = {line.split()[0]: line.split() for line in lines[header + 1:header + 4]}
    assert set(rows) == {"a", "b", "pooled"}
    assert float(rows["a"][3]) == pytest.approx(single["results"]["datasets"]["a"]["loss"],
                                                abs=1e-4)
    (run_dir,) = run_dirs(os.path.join(single["tmp"], "wandb_eval"))
    run = read_run(run_dir)
    logged = {k: v for row in run["history"] for k, v in row.items()}
    assert logged["eval/a/loss"] == pytest.approx(single["results"]["datasets"]["a"]["loss"])
    assert logged["eval/pooled/ppl"] == pytest.approx(single["results"]["pooled"]["ppl"])
    assert run["config"]["step"] == 2


# ---- bad input: refused before any compute, naming the option --------------------------

def _refused(trained, *overrides, datasets=("a",)) -> str:
    with pytest.raises(ConfigError) as e:
        compose_job(f"eval.checkpoint={trained['ckpt']}", datasets_option(trained["tmp"], datasets),
                    *overrides)
    return str(e.value)


@pytest.mark.multiproc
@pytest.mark.parametrize("overrides, option", [
    (["mixer=vanilla"], "mixer.name: checkpoint 'depth_attn'"),
    (["mixer=depth_attn", "mixer.stride=1"], "mixer.stride: checkpoint 2"),
    (["model=360m"], "model.hidden_size: checkpoint 64"),
    (["model.num_layers=8"], "model.num_layers: checkpoint 4"),
    (["model.vocab_size=50304"], "model.vocab_size: checkpoint 128"),
], ids=["other_mixer", "other_stride", "other_size", "other_depth", "other_vocab"])
def test_mismatched_options_are_refused(trained, overrides, option):
    assert option in _refused(trained, *overrides)


@pytest.mark.multiproc
def test_bad_datasets_and_layouts_are_refused(trained):
    assert "eval.datasets.small" in _refused(trained, datasets=("small",))
    assert "fewer than one window" in _refused(trained, datasets=("small",))
    assert "eval.datasets.other_vocab" in _refused(trained, datasets=("other_vocab",))
    assert "eval.datasets.nothing" in _refused(trained, datasets=("nothing",))
    assert "eval.tasks" in _refused(trained, "parallel.tp=2", "eval.tasks=[piqa]")
    # options that agree with the checkpoint are accepted
    job = compose_job(f"eval.checkpoint={trained['ckpt']}", datasets_option(trained["tmp"]),
                      "mixer=depth_attn", "model.num_layers=4", "model.vocab_size=128")
    assert job.run.mixer.stride == 2 and job.run.model.hidden_size == 64


@pytest.mark.multiproc(at_once=1)
def test_missing_checkpoint_exits_2(tmp_path):
    proc = subprocess.run(
        [PYTHON, "-m", "depthmix.cli.eval", f"eval.checkpoint={tmp_path}/nothing",
         f"eval.datasets={{a: {tmp_path}/a}}"],
        cwd=tmp_path, env=env_for_subprocess(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"configuration error: eval.checkpoint={tmp_path}/nothing: no such directory")
