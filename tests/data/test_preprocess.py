import json

import numpy as np
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset

from depthmix.data.corpus import iter_documents
from depthmix.data.preprocess import main, token_dtype
from depthmix.data.tokenizer import HFTokenizer, train_bpe_tokenizer

TEXTS = list(iter_documents(40, seed=5)) + ["unicode: héllo — 😀", " x ", "last one\n"]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(iter_documents(100), 400, str(path))
    return str(path)


def write_jsonl(path, texts, key="text"):
    data = "".join(json.dumps({key: t, "meta": {"i": i}}) + "\n" for i, t in enumerate(texts))
    if str(path).endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(data.encode("utf-8")))
    else:
        path.write_text(data, encoding="utf-8")


def read_documents(prefix):
    ds = IndexedDataset(prefix)
    assert len(ds.document_indices) == len(ds) + 1  # one sequence per document
    return ds, [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("ext,workers", [("jsonl", 1), ("jsonl.zst", 2)])
def test_documents_decode_back_with_eod(tmp_path, tok_path, ext, workers):
    src = tmp_path / f"docs.{ext}"
    write_jsonl(src, TEXTS)
    prefix = str(tmp_path / "out" / "docs")
    assert main(["--input", str(src), "--tokenizer", tok_path, "--output-prefix", prefix,
                 "--workers", str(workers), "--chunk-size", "7", "--no-progress"]) == 0
    ds, docs = read_documents(prefix)
    tok = HFTokenizer(tok_path)
    assert ds.index.dtype == np.uint16
    assert len(docs) == len(TEXTS)
    for text, ids in zip(TEXTS, docs):
        assert ids[-1] == tok.eod
        assert tok.decode(ids) == text + "<|endoftext|>"
        assert list(ids[:-1]) == tok.encode(text)


def test_glob_order_json_key_and_empty_documents(tmp_path, tok_path):
    write_jsonl(tmp_path / "b.jsonl", ["second file", ""], key="content")
    write_jsonl(tmp_path / "a.jsonl.zst", ["first file"], key="content")
    prefix = str(tmp_path / "globbed")
    assert main(["-i", str(tmp_path / "*.jsonl*"), "-t", tok_path, "-o", prefix,
                 "--json-key", "content", "-j", "1", "--no-progress"]) == 0
    _, docs = read_documents(prefix)
    tok = HFTokenizer(tok_path)
    assert [tok.decode(d) for d in docs] == ["first file<|endoftext|>",
                                             "second file<|endoftext|>"]


def test_clear_errors(tmp_path, tok_path, capsys):
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, ["a"])
    out = str(tmp_path / "o")
    assert main(["-i", str(tmp_path / "nope.jsonl"), "-t", tok_path, "-o", out]) == 1
    assert "nope.jsonl" in capsys.readouterr().err
    assert main(["-i", str(tmp_path / "*.zst"), "-t", tok_path, "-o", out]) == 1
    assert "matches no files" in capsys.readouterr().err
    assert main(["-i", str(src), "-t", str(tmp_path / "tok.json"), "-o", out]) == 1
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["-i", str(src), "-t", tok_path, "-o", out, "--json-key", "body",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "docs.jsonl:1" in err and "'body'" in err
    assert not list(tmp_path.glob("o*"))  # nothing half-written


def test_token_dtype():
    assert token_dtype(2048) == np.uint16
    assert token_dtype(50277) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.int32
