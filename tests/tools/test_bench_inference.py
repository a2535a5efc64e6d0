"""tools/bench_inference.py at a smoke shape: every mixer runs, and what it measures is right."""

import json

import pytest

from depthmix.mixers import available
from depthmix.mixers.attnres import AttnResGeometry

from tools_modules import load_tool


@pytest.fixture(scope="module")
def bench(megatron_single, tmp_path_factory):
    module = load_tool("bench_inference")
    out = str(tmp_path_factory.mktemp("bench") / "results.json")
    module.main(["--prefill", "5", "--decode", "2", "--batch", "2", "--reps", "1",
                 "--warmup", "0", "--json", out])
    with open(out) as f:
        return json.load(f)


def test_every_mixer_is_measured(bench):
    assert set(bench) == set(available()) | {"attnres_block[plain]"}
    for label, r in bench.items():
        assert r["prefill_s"] > 0 and r["decode_s_per_token"] > 0, label
        weights = 4 * r["params"]  # fp32
        assert r["prefill_peak_bytes"] > weights and r["decode_peak_bytes"] > weights, label


def test_kv_cache_bytes_per_token(bench):
    """Vanilla caches k and v per layer; Depth-Attention stores its mixed values in the V
    slot and no mixer keeps other persistent state."""
    from depthmix.config.load import compose_run

    m = compose_run("model=tiny").model
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    assert bench["vanilla"]["cache_bytes_per_token"] == m.num_layers * 2 * m.num_query_groups \
        * head_dim * 4
    for label, r in bench.items():
        assert r["cache_bytes_per_token"] == bench["vanilla"]["cache_bytes_per_token"], label
    # hidden-state methods carry their state within a forward: mHC n streams of d
    assert bench["mhc"]["depth_state_bytes_per_token"] == 4 * bench["vanilla"][
        "depth_state_bytes_per_token"]


def test_attnres_block_reads_two_phase_vs_plain(bench):
    from depthmix.config.load import compose_run

    m = compose_run("model=tiny").model
    geo = AttnResGeometry(2 * m.num_layers, 4)  # the tool's tiny block size
    two = bench["attnres_block"]["reads"]
    plain = bench["attnres_block[plain]"]["reads"]
    assert (two["attnres/source_reads"], two["attnres/block_reads"]) == geo.source_reads(True)
    assert (plain["attnres/source_reads"], plain["attnres/block_reads"]) == \
        geo.source_reads(False)
    assert two["attnres/source_reads"] < plain["attnres/source_reads"]
