"""Shared fixtures: one small embedded corpus built once per test session."""

import os

import pytest

from depthmix.config.schema import RunConfig


def small_run(cache_dir: str, **train) -> RunConfig:
    """300 short documents, a 512-token BPE, 32-token sequences, micro 2 / global 8."""
    run = RunConfig()
    run.model.vocab_size, run.model.seq_length = 512, 32
    run.data.cache_dir = cache_dir
    run.data.embedded_documents, run.data.embedded_vocab_size = 300, 512
    run.data.split = "90,10,0"
    t = run.train
    t.micro_batch_size, t.global_batch_size, t.steps = 2, 8, 20
    t.eval_iters, t.eval_interval, t.seed = 2, 10, 1234
    for key, value in train.items():
        setattr(t, key, value)
    return run


@pytest.fixture
def make_run():
    """``make_run(cache_dir, **train_overrides)`` -> the small :class:`RunConfig`."""
    return small_run


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """A cache directory holding the small embedded corpus (built by the first user)."""
    path = str(tmp_path_factory.mktemp("depthmix_cache"))
    from depthmix.data.datasets import prepare_embedded

    prepare_embedded(small_run(path))
    return path


@pytest.fixture(scope="session")
def embedded(data_cache):
    """Paths of the small embedded corpus: ``.corpus``, ``.tokenizer``, ``.prefix``."""
    from depthmix.data.datasets import embedded_paths

    paths = embedded_paths(data_cache, 300, 512)
    assert os.path.exists(paths.prefix + ".bin")
    return paths
