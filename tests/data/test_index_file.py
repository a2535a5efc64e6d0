"""check_prefix refuses .bin/.idx pairs that do not belong together, naming the prefix."""

import json
import os
import shutil

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from depthmix.config.load import compose_run
from depthmix.config.schema import ConfigError
from depthmix.pretrain.preflight import preflight
from depthmix.data import build_data
from depthmix.data.corpus import iter_documents
from depthmix.data.index_file import check_prefix
from depthmix.data.preprocess import preprocess


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, embedded):
    """Two preprocessed corpora of different sizes with the embedded tokenizer."""
    d = tmp_path_factory.mktemp("integrity")
    prefixes = {}
    for name, n in (("small", 20), ("large", 60)):
        src = d / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n"
                               for t in iter_documents(n, seed=n)))
        prefixes[name] = str(d / name)
        preprocess([str(src)], embedded.tokenizer, prefixes[name], progress=False)
    return prefixes


def copy_prefix(src: str, dst: str) -> str:
    for suffix in (".bin", ".idx"):
        shutil.copy(src + suffix, dst + suffix)
    return dst


def test_a_good_prefix_is_described(corpora, embedded):
    info = check_prefix(corpora["large"], "data.prefixes[0]", vocab_size=1492)
    ds = IndexedDataset(corpora["large"])
    assert info.documents == info.sequences == len(ds) == 60
    assert info.dtype == np.uint16
    assert info.tokens == int(ds.sequence_lengths.sum()) == os.path.getsize(
        corpora["large"] + ".bin") // 2
    assert info.max_token_id == max(int(ds[i].max()) for i in range(len(ds)))
    assert check_prefix(corpora["large"], "x", deep=False).tokens == info.tokens


@pytest.mark.parametrize("deep", [True, False])
def test_index_of_another_dataset_is_refused(tmp_path, corpora, deep):
    """The .idx of a smaller corpus beside a larger .bin: Megatron would train on it."""
    prefix = copy_prefix(corpora["large"], str(tmp_path / "mixed"))
    shutil.copy(corpora["small"] + ".idx", prefix + ".idx")
    bin_bytes = os.path.getsize(prefix + ".bin")
    small = IndexedDataset(corpora["small"])  # keep it: its arrays view its mmap
    idx_describes = 2 * int(small.sequence_lengths.sum())
    with pytest.raises(ConfigError) as e:
        check_prefix(prefix, "data.prefixes[1]", deep=deep)
    assert str(e.value).startswith(f"data.prefixes[1]={prefix}: mixed.bin has {bin_bytes} "
                                   f"bytes, mixed.idx describes {idx_describes}")


def test_truncated_bin_is_refused(tmp_path, corpora):
    prefix = copy_prefix(corpora["large"], str(tmp_path / "cut"))
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ConfigError, match=rf"data\.prefixes\[0\]=.*cut: cut\.bin has "
                                          rf"{size - 10} bytes, cut\.idx describes {size}"):
        check_prefix(prefix, "data.prefixes[0]")


def test_empty_prefix_is_refused(tmp_path):
    prefix = str(tmp_path / "empty")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.finalize(prefix + ".idx")  # what an empty jsonl used to produce
    with pytest.raises(ConfigError, match=r"data\.prefixes\[0\]=.*empty: empty dataset"):
        check_prefix(prefix, "data.prefixes[0]")


def test_damaged_index_is_refused(tmp_path, corpora):
    shutil.copy(corpora["large"] + ".bin", tmp_path / "lonely.bin")
    with pytest.raises(ConfigError, match=r"o=.*lonely: lonely\.idx not found"):
        check_prefix(str(tmp_path / "lonely"), "o")

    prefix = copy_prefix(corpora["large"], str(tmp_path / "bad"))

    header = bytearray(open(prefix + ".idx", "rb").read())
    for offset, value, message in ((0, b"X", "not a Megatron index"),
                                   (9, b"\x02", "index version 2"),
                                   (17, b"\x09", "dtype code 9")):
        damaged = bytearray(header)
        damaged[offset:offset + 1] = value
        open(prefix + ".idx", "wb").write(damaged)
        with pytest.raises(ConfigError, match=message):
            check_prefix(prefix, "o")
    open(prefix + ".idx", "wb").write(header[:-8])  # truncated index
    with pytest.raises(ConfigError, match=r"bad\.idx has \d+ bytes, its header"):
        check_prefix(prefix, "o")
    # Swap two sequence lengths: the total still matches the .bin, the offsets do not.
    seqs = int.from_bytes(header[18:26], "little")
    lengths = np.frombuffer(bytes(header[34:34 + 4 * seqs]), np.int32).copy()
    assert lengths[3] != lengths[4]
    lengths[[3, 4]] = lengths[[4, 3]]
    damaged = bytearray(header)
    damaged[34:34 + 4 * seqs] = lengths.tobytes()
    open(prefix + ".idx", "wb").write(damaged)
    with pytest.raises(ConfigError, match="sequence 4 has length"):
        check_prefix(prefix, "o")


def test_token_ids_beyond_the_vocabulary_are_refused(corpora):
    info = check_prefix(corpora["small"], "data.prefixes[0]", vocab_size=1492)
    with pytest.raises(ConfigError, match=rf"holds token id {info.max_token_id}, outside the "
                                          r"100-token vocabulary of data\.tokenizer"):
        check_prefix(corpora["small"], "data.prefixes[0]", vocab_size=100,
                     vocab_source="data.tokenizer")


def test_training_refuses_a_bad_prefix_at_start_up(tmp_path, corpora, embedded, data_cache,
                                                   make_run):
    """Both the start-up preflight (before any model) and build_data name the prefix."""
    prefix = copy_prefix(corpora["large"], str(tmp_path / "mixed"))
    shutil.copy(corpora["small"] + ".idx", prefix + ".idx")
    run = compose_run("data=pile", f"data.prefixes=[0.5,{corpora['small']},0.5,{prefix}]",
                      f"data.tokenizer={embedded.tokenizer}", "data.split='80,20,0'")
    with pytest.raises(ConfigError, match=rf"data\.prefixes\[3\]={prefix}: mixed\.bin has"):
        preflight(run, world_size=1)

    run = make_run(data_cache)
    run.data.name, run.data.tokenizer = "pile", embedded.tokenizer
    run.data.prefixes = [corpora["small"], prefix]
    with pytest.raises(ConfigError, match=rf"data\.prefixes\[1\]={prefix}: mixed\.bin has"):
        build_data(run, 0, 1)
