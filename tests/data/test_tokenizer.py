import json

import numpy as np
import pytest
import torch

from depthmix.data.corpus import iter_documents
from depthmix.data.tokenizer import HFTokenizer, train_bpe_tokenizer


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(iter_documents(200), 400, str(path))
    return str(path)


def test_special_ids_follow_gpt_neox(tok_path):
    tok = HFTokenizer(tok_path)
    assert (tok.eod, tok.eos, tok.bos, tok.pad) == (0, 0, 0, 1)
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|padding|>") == [1]
    assert 258 < tok.vocab_size <= 400
    json.dumps(tok.unique_identifiers)  # part of Megatron's cache hash: must serialise


@pytest.mark.parametrize("text", [
    "Once upon a time, there was a little fox named Tom.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "unicode: héllo wörld — 😀 日本語",
    "",
])
def test_round_trip(tok_path, text):
    tok = HFTokenizer(tok_path)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids)) == text
    assert tok.detokenize(torch.tensor(ids, dtype=torch.long)) == text
    assert tok.tokenize(text) == ids


def test_training_is_deterministic_and_compresses(tok_path):
    docs = list(iter_documents(200))
    again = train_bpe_tokenizer(docs, 400)
    tok = HFTokenizer(tok_path)
    assert again.to_str() == tok._tok.to_str()
    n_tokens = sum(len(tok.encode(d)) for d in docs)
    assert n_tokens < 0.5 * sum(len(d) for d in docs)  # merges were learned


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="258"):
        train_bpe_tokenizer(["abc"], 100)
    with pytest.raises(FileNotFoundError):
        HFTokenizer(str(tmp_path / "missing.json"))
