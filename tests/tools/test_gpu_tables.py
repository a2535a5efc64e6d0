"""tools/gpu_tables.py: every GPU table of docs/benchmarks.md is what its run file in
docs/gpu-runs/ generates (none while there are no run files), every committed run file
holds to the schema, and the generator's verdicts on a synthetic run file (a mixer row
within or beyond ``vanilla + 1.5 x extra floor``, a failed check, a row that did not run)."""

from __future__ import annotations

import copy
import os

from depthmix.planning import gpu_runs
from tools_modules import TOOLS, load_tool, markdown_rows

ROOT = os.path.dirname(TOOLS)


def test_docs_tables_are_what_the_committed_run_files_generate():
    tables = load_tool("gpu_tables")
    runs = tables.load_runs(tables.RUNS)  # refuses a run file that breaks the schema
    text = open(tables.DOC).read()
    assert tables.ANCHOR in text
    assert tables.disagreements(text, runs) == []
    named = {m.group("name").rpartition("/")[0] for m in tables.BLOCK.finditer(text)}
    assert named == set(runs)  # no run file without tables, no table without its file
    for stem in runs:
        assert os.path.exists(os.path.join(tables.RUNS, stem + ".log")), stem


def _run_file() -> dict:
    env = {k: None for k in gpu_runs.ENVIRONMENT_KEYS}
    env.update(device="NVIDIA H100 80GB HBM3", device_kind="h100", torch="2.11.0",
               triton="3.6.0", python="3.12.3", git_commit="0123456789abcdef",
               git_dirty=False)
    model = {"preset": "1p5b", "num_layers": 12, "hidden_size": 1536, "ffn_hidden_size": 4096,
             "num_attention_heads": 24, "num_query_groups": 6, "kv_channels": 64,
             "seq_length": 2048, "vocab_size": 50304}

    def step(mixer, impl, ms, floor=None):
        row = {"part": "mixers", "id": f"mixers/{mixer}/{impl}/eager", "status": "ok",
               "reason": None, "seconds": 3.0, "kind": "step", "model": model,
               "mixer": mixer, "impl": None if mixer == "vanilla" else impl, "mode": "eager",
               "micro_batch": 2, "precision": "bf16", "settings": {}, "params": 1,
               "steps": 4, "ms_per_step": ms, "tokens_per_s": 4096 / ms * 1e3,
               "flops_per_token": 1e10, "flops_per_token_causal": 9e9, "mfu": 0.2,
               "mfu_causal": 0.18, "peak_memory_gib": 20.0, "profile": None}
        if floor is not None:
            row.update(extra_floor={"ms": floor, "ops": {}}, vanilla_ms=100.0,
                       budget_ms=100.0 + 1.5 * floor,
                       within_floor_budget=ms <= 100.0 + 1.5 * floor)
        return row

    def moe(mixer, experts, ms, floor=None):
        row = step(mixer, "triton", ms, floor)
        row.update(part="moe", id=f"moe/{mixer}/{experts}/eager", experts_impl=experts)
        if floor is not None:
            row.update(vanilla_ms=50.0, budget_ms=50.0 + 1.5 * floor,
                       within_floor_budget=ms <= 50.0 + 1.5 * floor)
        return row

    rows = [step("vanilla", "torch", 100.0), step("depth_attn", "triton", 101.0, 1.0),
            step("mhc", "triton", 140.0, 7.0),
            {"part": "mixers", "id": "mixers/moda/torch/eager", "status": "oom",
             "reason": "OutOfMemoryError: CUDA out of memory", "seconds": 9.0},
            {"part": "checks", "id": "checks/test_stack::test_gpu[mhc]", "status": "ok",
             "reason": None, "seconds": 9.0, "kind": "check", "check": "test_stack::test_gpu[mhc]",
             "passed": False, "details": {"test": "tests/kernels/test_stack.py::test_gpu[mhc]",
                                          "message": "AssertionError: losses differ\n by 0.5"}},
            moe("vanilla", "grouped", 50.0), moe("vanilla", "sequential", 80.0),
            moe("mhc", "grouped", 55.0, 4.0),
            {"part": "moe", "id": "moe/mhc/sequential/eager", "status": "skipped",
             "reason": "time budget: ~15 s needed", "seconds": 0.0}]
    return {"schema": gpu_runs.SCHEMA, "tool": "tools/gpu_bench.py", "date": "2026-12-01",
            "started": "2026-12-01T00:00:00+00:00", "argv": [[]], "smoke": False,
            "environment": env, "options": {"train.compile": True}, "rows": rows,
            "parts": {"mixers": {"status": "done", "seconds": 20.0},
                      "moe": {"status": "done", "seconds": 12.0},
                      "checks": {"status": "done", "seconds": 9.0}}}


def test_the_generated_tables_show_each_verdict():
    tables = load_tool("gpu_tables")
    doc = _run_file()
    assert gpu_runs.validate(doc) == []
    generated = tables.tables(doc)
    assert list(generated) == ["environment", "mixers", "moe", "checks"]
    mixers = markdown_rows(generated["mixers"])
    assert mixers[2][:5] == ["depth_attn", "triton", "eager", "101.0", "1.01"]
    assert mixers[2][-2:] == ["1.00", "pass (≤ 101.5)"]
    assert mixers[3][-2:] == ["7.00", "fail (≤ 110.5)"]
    assert mixers[4][-1] == "oom: OutOfMemoryError: CUDA out of memory"
    check = markdown_rows(generated["checks"])[1]
    assert check == ["test_stack::test_gpu[mhc]", "**FAIL**", "AssertionError: losses differ by 0.5"]
    moe = markdown_rows(generated["moe"])  # x vanilla over the same experts, x sequential
    assert moe[1][:7] == ["vanilla", "grouped", "", "eager", "50.0", "–", "0.62"]
    assert moe[3][:7] == ["mhc", "grouped", "triton", "eager", "55.0", "1.10", "–"]
    assert moe[3][-1] == "pass (≤ 56.0)"
    assert moe[4][-1] == "skipped: time budget: ~15 s needed"
    stem = tables.stem_of(doc)
    assert stem == "2026-12-01-h100-0123456789"
    text, problems = tables.render(f"{tables.ANCHOR}\n", {stem: doc})
    assert problems == [] and text.count("<!-- /gpu-table -->") == 4
    changed = copy.deepcopy(doc)
    changed["rows"][1]["ms_per_step"] = 99.0
    assert tables.disagreements(text, {stem: changed}) == [
        f"table {stem}/mixers: differs from its run file"]
