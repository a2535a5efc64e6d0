"""Session fixtures: the Hugging Face folders of :mod:`hf_models`, imported once."""

import pytest

from hf_models import KINDS, SEQ, TEXTS, VOCAB, hf_model, save_hf, write_tokens


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """kind -> a Hugging Face model folder (safetensors, config.json, tokenizer)."""
    from depthmix.data.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("hf")
    tokenizer = str(root / "tokenizer_src.json")
    train_bpe_tokenizer(TEXTS, VOCAB - 20, tokenizer)
    return {kind: save_hf(hf_model(kind), str(root / kind), tokenizer) for kind in KINDS}


@pytest.fixture(scope="session")
def imported(hf_dirs, tmp_path_factory):
    """kind -> the depthmix-import output directory (``--seq-length 16``)."""
    from depthmix.cli.importer import main

    root = tmp_path_factory.mktemp("imported")
    out = {}
    for kind, path in hf_dirs.items():
        out[kind] = str(root / kind)
        assert main([path, out[kind], "--seq-length", str(SEQ), "--name", kind]) == 0
    return out


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A 200-token dataset: 13 windows of 16 tokens, the last one partial."""
    prefix = str(tmp_path_factory.mktemp("data") / "d")
    write_tokens(prefix, 200, seed=0)
    return prefix
