import gzip
import json

import numpy as np
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset

from depthmix.data.corpus import iter_documents
from depthmix.data.index_file import check_prefix
from depthmix.cli.preprocess import main
from depthmix.data.preprocess import (_split_names, expand_inputs, preprocess, read_manifest,
                                      split_name, token_dtype)
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


@pytest.mark.parametrize("ext,workers", [
    ("jsonl", 1), pytest.param("jsonl.zst", 2, marks=pytest.mark.multiproc)])
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
    assert main(["-i", str(tmp_path / "nope.jsonl"), "-t", tok_path, "-o", out]) == 2
    assert "nope.jsonl" in capsys.readouterr().err  # missing paths: status 2, before any work
    assert main(["-i", str(tmp_path / "*.zst"), "-t", tok_path, "-o", out]) == 2
    assert "matches no files" in capsys.readouterr().err
    assert main(["-i", str(src), "-t", str(tmp_path / "tok.json"), "-o", out]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["-i", str(src), "-t", tok_path, "-o", out, "--json-key", "body",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "docs.jsonl:1" in err and "'body'" in err
    assert not list(tmp_path.glob("o*"))  # nothing half-written


def test_library_refuses_missing_paths_too(tmp_path, tok_path):
    """``preprocess()`` called from Python (no CLI in front to check the paths first)."""
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, ["a"])
    with pytest.raises(FileNotFoundError, match="nope.jsonl': no such file"):
        expand_inputs([str(tmp_path / "nope.jsonl")])
    with pytest.raises(FileNotFoundError, match="matches no files"):
        expand_inputs([str(tmp_path / "*.zst")])
    with pytest.raises(FileNotFoundError, match="--tokenizer .*tok.json': no such file"):
        preprocess([str(src)], str(tmp_path / "tok.json"), str(tmp_path / "o"))
    assert not list(tmp_path.glob("o*"))


def test_token_dtype():
    assert token_dtype(2048) == np.uint16
    assert token_dtype(50277) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.int32


def outputs_in(directory):
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("src"))


def test_truncated_compressed_input_fails_and_keeps_the_old_output(tmp_path, tok_path, capsys):
    out = str(tmp_path / "o")
    good = tmp_path / "src.jsonl.zst"
    write_jsonl(good, TEXTS)
    assert main(["-i", str(good), "-t", tok_path, "-o", out, "--no-progress", "-j", "1"]) == 0
    before = {s: (tmp_path / f"o{s}").read_bytes() for s in (".bin", ".idx")}
    data = good.read_bytes()
    for cut in (len(data) - 3, len(data) // 2, 10):
        src = tmp_path / "src_cut.jsonl.zst"
        src.write_bytes(data[:cut])
        assert main(["-i", str(src), "-t", tok_path, "-o", out, "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert "src_cut.jsonl.zst: truncated or damaged compressed file" in err, err
        assert outputs_in(tmp_path) == ["o.bin", "o.idx"]  # no temporary files left
        assert {s: (tmp_path / f"o{s}").read_bytes() for s in (".bin", ".idx")} == before
    gz = tmp_path / "src.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:-6])
    assert main(["-i", str(gz), "-t", tok_path, "-o", out, "--no-progress"]) == 1
    assert "src.jsonl.gz: truncated" in capsys.readouterr().err


def test_every_zstd_frame_is_read(tmp_path, tok_path):
    src = tmp_path / "frames.jsonl.zst"
    frames = [TEXTS[:10], TEXTS[10:11], TEXTS[11:]]
    src.write_bytes(b"".join(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in f).encode()) for f in frames))
    prefix = str(tmp_path / "frames")
    assert main(["-i", str(src), "-t", tok_path, "-o", prefix, "--no-progress"]) == 0
    tok = HFTokenizer(tok_path)
    _, docs = read_documents(prefix)
    assert [tok.decode(d) for d in docs] == [t + "<|endoftext|>" for t in TEXTS]


def test_decode_errors_name_file_and_line(tmp_path, tok_path, capsys):
    src = tmp_path / "src.jsonl"
    src.write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')  # latin-1, line 3
    assert main(["-i", str(src), "-t", tok_path, "-o", str(tmp_path / "o"),
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"{src}:3: not valid UTF-8" in err, err
    src.write_bytes(b'{"text": "ok"}\n{"text": "unterminated}\n')
    assert main(["-i", str(src), "-t", tok_path, "-o", str(tmp_path / "o"),
                 "--no-progress"]) == 1
    assert f"{src}:2: not valid JSON" in capsys.readouterr().err
    assert outputs_in(tmp_path) == []


@pytest.mark.parametrize("content", ["", "\n\n", '{"text": ""}\n{"text": ""}\n'])
def test_no_documents_is_an_error(tmp_path, tok_path, capsys, content):
    src = tmp_path / "src.jsonl"
    src.write_text(content)
    assert main(["-i", str(src), "-t", tok_path, "-o", str(tmp_path / "o"),
                 "--no-progress"]) == 1
    assert "no documents in" in capsys.readouterr().err
    assert outputs_in(tmp_path) == []


DOMAINS = ["Pile-CC", "Gutenberg (PG-19)", "Wikipedia (en)"]


@pytest.mark.multiproc  # two preprocessing workers
def test_split_by_writes_one_prefix_per_domain(tmp_path, tok_path, capsys):
    texts = list(iter_documents(30, seed=9))
    domain_of = [DOMAINS[(i * 7) % 5 % 3] for i in range(len(texts))]
    src = tmp_path / "src_val.jsonl.zst"
    src.write_bytes(zstandard.ZstdCompressor().compress("".join(
        json.dumps({"text": t, "meta": {"pile_set_name": d}}) + "\n"
        for t, d in zip(texts, domain_of)).encode()))
    out = str(tmp_path / "pile_val")
    assert main(["-i", str(src), "-t", tok_path, "-o", out, "--split-by", "meta.pile_set_name",
                 "-j", "2", "--chunk-size", "4", "--no-progress"]) == 0
    assert "wrote 3 prefixes" in capsys.readouterr().out
    names = {"Pile-CC": "Pile-CC", "Gutenberg (PG-19)": "Gutenberg_PG-19",
             "Wikipedia (en)": "Wikipedia_en"}
    assert outputs_in(tmp_path) == sorted(
        [f"pile_val_{n}{s}" for n in names.values() for s in (".bin", ".idx")]
        + ["pile_val.manifest.json"])

    manifest = json.loads((tmp_path / "pile_val.manifest.json").read_text())
    assert manifest["split_by"] == "meta.pile_set_name"
    assert manifest["inputs"] == [str(src)] and manifest["tokenizer"] == tok_path
    assert read_manifest(str(tmp_path / "pile_val.manifest.json")) == manifest["datasets"] == {
        n: f"{out}_{n}" for n in names.values()}
    tok = HFTokenizer(tok_path)
    assert [s["value"] for s in manifest["splits"]] == sorted(DOMAINS)
    for split in manifest["splits"]:
        assert split["name"] == names[split["value"]]
        expect = [t for t, d in zip(texts, domain_of) if d == split["value"]]
        ds, docs = read_documents(split["prefix"])
        assert [tok.decode(ids) for ids in docs] == [t + "<|endoftext|>" for t in expect]
        assert split["documents"] == len(expect)
        assert split["tokens"] == int(ds.sequence_lengths.sum()) == sum(
            len(tok.encode(t)) + 1 for t in expect)
        assert check_prefix(split["prefix"], "x").documents == len(expect)
    assert manifest["documents"] == len(texts)


def test_split_by_errors_and_name_collisions(tmp_path, tok_path, capsys):
    src = tmp_path / "src.jsonl"
    src.write_text('{"text": "a", "meta": {"pile_set_name": "x"}}\n{"text": "b", "meta": {}}\n')
    assert main(["-i", str(src), "-t", tok_path, "-o", str(tmp_path / "o"),
                 "--split-by", "meta.pile_set_name", "--no-progress"]) == 1
    assert f"{src}:2: no 'meta.pile_set_name' field (--split-by)" in capsys.readouterr().err
    assert outputs_in(tmp_path) == []

    assert split_name("Gutenberg (PG-19)") == "Gutenberg_PG-19"
    assert split_name("../..") == "_"
    names = _split_names(["a b", "a_b", "c"])
    assert names["c"] == "c" and len(set(names.values())) == 3
    assert names["a b"].startswith("a_b-") and names["a_b"].startswith("a_b-")
    assert _split_names(["a_b", "a b", "c"]) == names  # independent of order


def test_files_are_byte_identical_to_megatrons_builder(tmp_path, tok_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    src = tmp_path / "docs.jsonl"
    write_jsonl(src, TEXTS)
    ours = str(tmp_path / "ours")
    assert main(["-i", str(src), "-t", tok_path, "-o", ours, "--no-progress"]) == 0
    tok = HFTokenizer(tok_path)
    theirs = str(tmp_path / "theirs")
    builder = IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
    for text in TEXTS:
        ids = tok.encode(text) + [tok.eod]
        builder.add_document(np.array(ids), [len(ids)])
    builder.finalize(theirs + ".idx")
    for suffix in (".bin", ".idx"):
        assert open(ours + suffix, "rb").read() == open(theirs + suffix, "rb").read()
