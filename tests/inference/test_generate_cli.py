"""`depthmix-generate` as a real process on the README's tiny checkpoint (a few steps of
`depthmix-train model=tiny`): its greedy text is `generate()`'s, and a batch of prompts of
different lengths gives each prompt what it gives alone."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The", "A little bird sat on the old"]


def _command(name):
    script = os.path.join(os.path.dirname(sys.executable), name)
    return [script] if os.path.exists(script) else [sys.executable, "-m", {
        "depthmix-train": "depthmix.cli.train",
        "depthmix-generate": "depthmix.cli.generate"}[name]]


def _run(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    _run(_command("depthmix-train") + [
        "model=tiny", "train.steps=6", "logger=none", "train.eval_interval=0",
        "data.embedded_documents=600", f"hydra.run.dir={root}/run",
        f"data.cache_dir={root}/cache"], timeout=600)
    return str(root / "run" / "checkpoints")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    from depthmix.data.tokenizer import HFTokenizer
    from depthmix.inference.load import load_model

    model = load_model(checkpoint, impl="torch")
    return model, HFTokenizer(model.tokenizer_path)


def _alone(loaded, prompt, **kwargs):
    from depthmix.inference.generate import generate

    model, tok = loaded
    ids = torch.tensor([tok.encode(prompt)])
    out = generate(model.model, ids, 12, eos_id=tok.eod, vocab_size=model.vocab_size,
                   **kwargs)[0, ids.shape[1]:].tolist()
    return out[: out.index(tok.eod)] if tok.eod in out else out


def test_greedy_streamed_text_is_generates(checkpoint, loaded):
    out = _run(_command("depthmix-generate") + [checkpoint, "-p", PROMPTS[0], "-n", "12",
                                                 "--impl", "torch"])
    assert out == PROMPTS[0] + loaded[1].decode(_alone(loaded, PROMPTS[0])) + "\n"


def test_batched_prompts_equal_each_alone(checkpoint, loaded, tmp_path):
    """Sampled, so that the rows differ; every row's generator starts from --seed."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = _run(_command("depthmix-generate") + [
        checkpoint, "-f", str(prompts), "-n", "12", "--temperature", "1.0", "--top-k", "40",
        "--seed", "7", "--batch-size", "3", "--format", "jsonl", "--impl", "torch"])
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    for row in rows:
        alone = _alone(loaded, row["prompt"], temperature=1.0, top_k=40,
                       generator=torch.Generator().manual_seed(7))
        assert row["tokens"] == alone, row
        assert row["completion"] == loaded[1].decode(alone)


def test_missing_checkpoint_is_refused_naming_it(capsys, tmp_path):
    from depthmix.cli.generate import main

    assert main([str(tmp_path / "nowhere"), "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint=" in err and "nowhere" in err
