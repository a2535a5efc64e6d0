"""`depthmix-generate` as a real process on the README's tiny checkpoint (the session's
`depthmix-train model=tiny`, ``tiny_training``): its greedy text is `generate()`'s, and a
batch of prompts of different lengths gives each prompt what it gives alone."""

import json

import pytest
import torch

from cli_processes import run

pytestmark = pytest.mark.multiproc(at_once=1)

PROMPTS = ["Once upon a time", "The", "A little bird sat on the old"]


def _run(args, timeout=300):
    return run("depthmix-generate", args, timeout=timeout, installed=True).stdout


@pytest.fixture(scope="module")
def checkpoint(tiny_training):
    return str(tiny_training[0] / "checkpoints")


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
    out = _run([checkpoint, "-p", PROMPTS[0], "-n", "12", "--impl", "torch"])
    assert out == PROMPTS[0] + loaded[1].decode(_alone(loaded, PROMPTS[0])) + "\n"


def test_batched_prompts_equal_each_alone(checkpoint, loaded, tmp_path):
    """Sampled, so that the rows differ; every row's generator starts from --seed."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = _run([
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
