import json
import os

import pytest
import torch

from depthmix.pretrain.preflight import preflight
from depthmix.config.schema import ConfigError
from depthmix.data import build_data
from depthmix.data.corpus import iter_documents
from depthmix.data.preprocess import preprocess
from depthmix.data.tokenizer import train_bpe_tokenizer


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_shapes_dtypes_and_shifted_labels(data_cache, make_run):
    run = make_run(data_cache)
    data = build_data(run, 0, 1)
    assert (data.tokenizer.eod, data.tokenizer.pad) == (0, 1)
    assert data.tokenizer.vocab_size <= run.model.vocab_size
    assert data.num_micro_batches == 4
    assert len(data.train_dataset) >= run.train.steps * run.train.global_batch_size
    ds = data.train_dataset
    for i, batch in enumerate(take(data.train_iterator, 5)):
        assert sorted(batch) == ["labels", "loss_mask", "position_ids", "tokens"]
        for key, dtype in [("tokens", torch.int64), ("labels", torch.int64),
                           ("loss_mask", torch.float32), ("position_ids", torch.int64)]:
            assert batch[key].shape == (2, 32) and batch[key].dtype == dtype, key
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
        assert torch.equal(batch["position_ids"], torch.arange(32).expand(2, 32))
        assert torch.all(batch["loss_mask"] == 1)
        assert int(batch["tokens"].max()) < data.tokenizer.vocab_size
        # Micro-batch i of DP rank 0 holds global samples 2i, 2i+1.
        for j in range(2):
            sample = ds[2 * i + j]
            assert torch.equal(batch["tokens"][j], sample["tokens"])
            assert torch.equal(batch["labels"][j], sample["labels"])
    # Samples are corpus text: each piece between end-of-document tokens lies in one document.
    corpus = "\n".join(iter_documents(300, seed=0))
    for batch in take(data.train_iterator, 5):
        for row in batch["tokens"]:
            pieces = data.tokenizer.decode(row).split("<|endoftext|>")
            assert all(piece in corpus for piece in pieces)


def test_dp2_ranks_together_see_the_dp1_samples(data_cache, make_run):
    run = make_run(data_cache)
    dp1 = take(build_data(run, 0, 1).train_iterator, 12)  # 3 steps x 4 micro-batches
    r0 = take(build_data(run, 0, 2).train_iterator, 6)    # 3 steps x 2 micro-batches
    r1 = take(build_data(run, 1, 2).train_iterator, 6)
    for step in range(3):
        # Megatron order: chunks of mbs*dp samples, rank r takes the r-th micro-batch.
        merged = [b for pair in zip(r0[2 * step:2 * step + 2], r1[2 * step:2 * step + 2])
                  for b in pair]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            expect = torch.cat([b[key] for b in dp1[4 * step:4 * step + 4]])
            assert torch.equal(torch.cat([b[key] for b in merged]), expect), (step, key)


@pytest.mark.parametrize("dp_rank,dp_size", [(0, 1), (1, 2)])
def test_resume_continues_the_exact_data_position(data_cache, make_run, dp_rank, dp_size):
    run = make_run(data_cache)
    gbs, k = run.train.global_batch_size, 3
    per_step = gbs // (run.train.micro_batch_size * dp_size)
    original = take(build_data(run, dp_rank, dp_size).train_iterator, (k + 2) * per_step)
    resumed = take(build_data(run, dp_rank, dp_size, consumed_train_samples=k * gbs)
                   .train_iterator, 2 * per_step)
    for a, b in zip(original[k * per_step:], resumed):
        assert torch.equal(a["tokens"], b["tokens"])
        assert torch.equal(a["labels"], b["labels"])
    assert not torch.equal(original[0]["tokens"], resumed[0]["tokens"])


def test_train_iterator_is_infinite(data_cache, make_run):
    run = make_run(data_cache, steps=1)
    data = build_data(run, 0, 1)
    n = len(data.train_dataset)
    batches = take(data.train_iterator, n // 2 + 3)  # wraps past the end
    assert torch.equal(batches[n // 2]["tokens"][0], data.train_dataset[2 * (n // 2) % n]
                       ["tokens"])


def test_valid_iterator_is_fresh_and_finite(data_cache, make_run):
    run = make_run(data_cache)
    data = build_data(run, 1, 2)
    first, second = list(data.valid_iterator()), list(data.valid_iterator())
    assert len(first) == run.train.eval_iters * data.num_micro_batches
    for a, b in zip(first, second):
        assert torch.equal(a["tokens"], b["tokens"])
    assert first[0]["tokens"].shape == (2, 32)
    assert list(data.test_iterator()) == []  # split 90,10,0: no test data
    train_first = next(build_data(run, 1, 2).train_iterator)
    assert not torch.equal(first[0]["tokens"], train_first["tokens"])


def test_loader_workers_give_the_same_batches(data_cache, make_run):
    run = make_run(data_cache)
    ref = take(build_data(run, 1, 2).train_iterator, 3)
    run.data.num_workers = 1
    data = build_data(run, 1, 2)
    for a, b in zip(ref, take(data.train_iterator, 3)):
        assert torch.equal(a["tokens"], b["tokens"])
    assert len(list(data.valid_iterator())) == run.train.eval_iters * data.num_micro_batches


def test_seed_changes_order_not_corpus(data_cache, make_run):
    a = build_data(make_run(data_cache), 0, 1)
    b = build_data(make_run(data_cache, seed=7), 0, 1)
    assert a.tokenizer.path == b.tokenizer.path
    assert not torch.equal(next(a.train_iterator)["tokens"], next(b.train_iterator)["tokens"])


@pytest.fixture(scope="module")
def two_prefixes(tmp_path_factory, embedded):
    """Two preprocessed corpora (different seeds) sharing the embedded tokenizer."""
    d = tmp_path_factory.mktemp("blend")
    prefixes = []
    for seed in (11, 12):
        src = d / f"c{seed}.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n"
                               for t in iter_documents(60, seed=seed)))
        prefix = str(d / f"c{seed}")
        preprocess([str(src)], embedded.tokenizer, prefix, progress=False)
        prefixes.append(prefix)
    return prefixes


def test_blends(data_cache, make_run, embedded, two_prefixes):
    from megatron.core.datasets.blended_dataset import BlendedDataset

    run = make_run(data_cache, steps=50)
    run.data.name, run.data.tokenizer = "pile", embedded.tokenizer
    run.data.prefixes = [0.25, two_prefixes[0], 0.75, two_prefixes[1]]
    had_group = torch.distributed.is_initialized()
    data = build_data(run, 0, 1)
    assert isinstance(data.train_dataset, BlendedDataset)
    assert torch.distributed.is_initialized() == had_group  # a lent world is given back
    assert data.weights == [0.25, 0.75]
    share = float((data.train_dataset.dataset_index == 0).mean())
    assert abs(share - 0.25) < 0.02
    assert next(data.train_iterator)["tokens"].shape == (2, 32)

    run.data.prefixes = ["0.5", two_prefixes[0], "0.5", two_prefixes[1]]  # strings from CLI
    assert build_data(run, 0, 1).weights == [0.5, 0.5]
    run.data.prefixes = list(two_prefixes)  # no weights: proportional to size
    data = build_data(run, 0, 1)
    assert data.weights is None and next(data.train_iterator)["tokens"].shape == (2, 32)


def test_config_errors(tmp_path, data_cache, make_run, embedded, two_prefixes):
    """Refused at start-up (the preflight the trainer runs before build_data)."""
    run = make_run(data_cache)
    run.data.name, run.data.tokenizer = "pile", embedded.tokenizer
    run.data.prefixes = [str(tmp_path / "missing")]
    with pytest.raises(ConfigError, match=r"data\.prefixes\[0\]=.*missing: missing\.bin and "
                                          r"missing\.idx not found"):
        build_data(run, 0, 1)
    with pytest.raises(ConfigError, match=r"data\.prefixes: .*missing\.bin/\.idx not found"):
        preflight(run, 1)

    run.data.prefixes = [two_prefixes[0]]
    run.data.tokenizer = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*nope\.json not found"):
        preflight(run, 1)
    run.data.tokenizer = None
    with pytest.raises(ConfigError, match=r"data\.tokenizer"):
        preflight(run, 1)

    big = tmp_path / "big.json"
    train_bpe_tokenizer(iter_documents(300), 700, str(big))
    run.data.tokenizer = str(big)
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*more than model\.vocab_size=512"):
        preflight(run, 1)

    run.data.tokenizer = embedded.tokenizer
    for bad in ([0.5, two_prefixes[0], two_prefixes[1]], [two_prefixes[0], 0.5],
                [-1, two_prefixes[0]]):
        run.data.prefixes = bad
        with pytest.raises(ConfigError, match=r"data\.prefixes"):
            preflight(run, 1)
    run.data.prefixes = [two_prefixes[0]]
    for split in ("0,1,0", "a,b", "99.9,0.1"):  # no train / unparsable / empty valid split
        run.data.split = split
        with pytest.raises(ConfigError, match=r"data\.split"):
            preflight(run, 1)
    run.data.split = "90,10,0"
    with pytest.raises(ConfigError, match=r"train\.global_batch_size"):
        preflight(run, 3)

    emb = make_run(data_cache)
    emb.model.vocab_size = 256
    with pytest.raises(ConfigError, match=r"data\.embedded_vocab_size=512 .*model\.vocab_size"):
        preflight(emb, 1)
    emb = make_run(data_cache)
    emb.data.name = "pile"
    with pytest.raises(ConfigError, match=r"data\.prefixes"):
        preflight(emb, 1)


def test_preflight_reads_the_document_count_megatron_reads(two_prefixes):
    """The count the split check reads (:func:`depthmix.data.checks.check_data`)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from depthmix.data.index_file import check_prefix

    for prefix in two_prefixes:
        sequences = check_prefix(prefix, "data.prefixes", deep=False).sequences
        assert sequences == len(IndexedDataset(prefix, mmap=True).sequence_lengths)


def test_cache_is_reused(data_cache, make_run, embedded):
    run = make_run(data_cache, steps=7)
    build_data(run, 0, 1)
    index_dir = os.path.join(data_cache, "indices")
    before = {f: os.path.getmtime(os.path.join(index_dir, f)) for f in os.listdir(index_dir)}
    corpus_mtime = os.path.getmtime(embedded.prefix + ".bin")
    build_data(run, 0, 1)
    after = {f: os.path.getmtime(os.path.join(index_dir, f)) for f in os.listdir(index_dir)}
    assert before == after
    assert os.path.getmtime(embedded.prefix + ".bin") == corpus_mtime
