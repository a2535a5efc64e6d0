"""tools/gpu_bench.py, the first thing a GPU session runs: its smoke run on the CPU (tiny
shapes, every part; the full lane) writes a run file the schema
(``depthmix.planning.gpu_runs``) and the table generator (``tools/gpu_tables.py``) accept,
so the script cannot rot between GPU sessions, and its checks part runs the ``gpu`` tests
(skipped here, saying why); rows record their errors, skips and time-outs and move on; a
second call appends to the same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from depthmix.planning import gpu_runs
from tools_modules import TOOLS, load_tool

ROOT = os.path.dirname(TOOLS)


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", PYTHONUNBUFFERED="1",
               TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("OUT", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_run")
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "gpu_bench.py"), "--smoke",
                           "--out", str(out), "--budget-s", "0"],
                          capture_output=True, text=True, env=_env(), cwd=out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("*.json")
    return path, gpu_runs.load(path), proc.stdout


SMOKE_WORKER = pytest.mark.xdist_group("test_gpu_bench:smoke")  # one smoke run, not one per worker


@pytest.mark.full
@pytest.mark.multiproc(at_once=1)
@SMOKE_WORKER
def test_smoke_run_writes_a_valid_run_file_of_every_part(smoke):
    path, doc, stdout = smoke
    assert gpu_runs.validate(doc) == []
    env = doc["environment"]
    assert path.stem == gpu_runs.file_stem(doc["date"], None, env["git_commit"])
    assert path.stem.split("-")[3] == "cpu" and env["git_commit"] != "unknown"
    assert path.with_suffix(".log").read_text().count("\n-- ") >= 10
    assert {p: s["status"] for p, s in doc["parts"].items()} == dict.fromkeys(
        gpu_runs.PARTS, "done")
    rows = {r["id"]: r for r in doc["rows"]}
    assert {i for i, r in rows.items() if r["status"] == "ok"} >= {
        "vanilla/tiny-L4/mb1/eager", "vanilla/tiny-L4/mb2/eager",
        "mixers/vanilla/torch/eager", "mixers/depth_attn/torch/eager",
        "mixers/depth_attn/triton/eager", "mixers/ddl/torch/eager",
        "mixers/peer/hf_qwen3/eager",
        "kernels/moda T64-G2-hd32-D4-np4-fp32/sdpa", "kernels/moda T64-G2-hd32-D4-np4-fp32/ours"}
    kernels = [r for r in doc["rows"] if r["part"] == "kernels"]
    assert kernels[0]["ratio"] == 1.0 and all(r["ratio"] > 0 for r in kernels)
    # the MoE rows: each mixer and each experts implementation once, the mixer's against
    # vanilla over the same experts
    moe = {i: r for i, r in rows.items() if r["part"] == "moe"}
    assert set(moe) == {"moe/vanilla/grouped/eager", "moe/vanilla/sequential/eager",
                        "moe/attnres_block/grouped/eager", "moe/mhc/sequential/eager"}
    assert all(r["status"] == "ok" for r in moe.values()), moe
    assert {r["experts_impl"] for r in moe.values()} == {"grouped", "sequential"}
    assert moe["moe/vanilla/grouped/eager"]["model"]["experts"]["num_experts"] == 4
    assert moe["moe/mhc/sequential/eager"]["vanilla_ms"] == \
        moe["moe/vanilla/sequential/eager"]["ms_per_step"]
    assert rows["vanilla/tiny-L4/mb1/eager"]["model"]["experts"] is None
    assert rows["vanilla/tiny-L4/mb1/compiled+graphs"]["status"] == "skipped"
    assert rows["mixers/ddl/triton/eager"]["status"] == "ok"  # DDL has kernels
    step = rows["vanilla/tiny-L4/mb2/eager"]
    assert step["flops_per_token_causal"] < step["flops_per_token"]
    assert step["profile"]["host_ms"] > 0 and step["settings"]["train.compile"] == "false"
    assert doc["parts"]["mixers"]["setting"]["micro_batch"] in (1, 2)
    mixer = rows["mixers/depth_attn/torch/eager"]
    assert mixer["extra_floor"]["ops"]["depth_mix"]["calls"] == 3
    assert mixer["budget_ms"] == pytest.approx(
        rows["mixers/vanilla/torch/eager"]["ms_per_step"] + 1.5 * mixer["extra_floor"]["ms"])
    # the checks are the gpu-marked tests, run by pytest: without CUDA each skips, saying so
    checks = {i: r for i, r in rows.items() if r["part"] == "checks"}
    assert {"checks/test_async_save::test_a_writer_forked_from_a_cuda_process_stays_off_the_gpu",
            "checks/test_stack::test_compiled_kernels_train_like_torch_on_the_gpu[ddl]"} <= set(
        checks), sorted(checks)
    assert all(r["status"] == "skipped" and "needs a CUDA GPU" in r["reason"]
               for r in checks.values()), checks
    assert f"== {len(doc['rows'])} rows" in stdout and len(doc["rows"]) >= 13


@pytest.mark.full
@pytest.mark.multiproc(at_once=1)
@SMOKE_WORKER
def test_the_table_generator_renders_the_smoke_run_and_finds_a_tampered_table(smoke,
                                                                              tmp_path):
    tables = load_tool("gpu_tables")
    path, doc, _ = smoke
    runs = {path.stem: doc}
    text = f"# Benchmarks\n\n{tables.ANCHOR}\n\nthe rest\n"
    rendered, problems = tables.render(text, runs)
    assert problems == [] and rendered != text
    for name in ("environment", "vanilla", "mixers", "moe", "peers", "profile", "kernels",
                 "checks"):
        assert f"<!-- gpu-table:{path.stem}/{name} -->" in rendered
    assert tables.disagreements(rendered, runs) == []
    assert tables.render(rendered, runs) == (rendered, [])  # a second run changes nothing
    ms = f"{doc['rows'][0]['ms_per_step']:,.1f}"
    tampered = rendered.replace(f"| {ms} ", "| 0.1 ", 1)  # the cell, padded or not
    assert tampered != rendered
    assert tables.disagreements(tampered, runs) == [
        f"table {path.stem}/vanilla: differs from its run file"]
    assert tables.disagreements(rendered, {}) == [
        f"table {path.stem}/{name}: no run file {path.stem}.json" for name in tables.tables(doc)]
    assert tables.render("no anchor\n", runs)[1] == [
        f"no {tables.ANCHOR} line to put the tables of {path.stem} after"]


@pytest.mark.multiproc(at_once=1)
def test_a_typo_exits_2_naming_the_option_before_torch_is_imported(tmp_path):
    code = ("import runpy, sys\nsys.modules['torch'] = None\n"
            f"sys.argv = [{os.path.join(TOOLS, 'gpu_bench.py')!r}, '--smok']\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "did you mean '--smoke'" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------
# Rows: errors, skips, the time budget, appending (in this process, no model)
# ---------------------------------------------------------------------------------------


def _run_file(tool, out, *argv):
    env = {k: None for k in gpu_runs.ENVIRONMENT_KEYS}
    env.update(device="CPU", git_commit="0123456789abcdef")
    return tool.RunFile(tool.parse_args(["--smoke", *argv]), str(out), env, {})


def test_each_row_records_its_outcome_and_the_file_is_written_at_once(tmp_path):
    tool = load_tool("gpu_bench")
    rf = _run_file(tool, tmp_path)
    rf.start_part("vanilla")
    rf.row("vanilla", "vanilla/a", "eager", lambda: {"kind": "check", "check": "a",
                                                     "passed": True, "details": {}})
    on_disk = gpu_runs.load(rf.path)
    assert [r["id"] for r in on_disk["rows"]] == ["vanilla/a"]

    def broken():
        raise RuntimeError("boom")

    def oom():
        raise torch_oom()

    def skip():
        raise tool.Skip("not here")

    rf.row("vanilla", "vanilla/b", "eager", broken)
    rf.row("vanilla", "vanilla/c", "eager", oom)
    rf.row("vanilla", "vanilla/d", "eager", skip)
    rf.deadline = 0.0  # out of time: recorded as skipped, with the command that runs it
    rf.smoke = False
    rf.row("vanilla", "vanilla/e", "compiled", broken)
    rf.end_part("vanilla")
    rows = {r["id"]: r for r in gpu_runs.load(rf.path)["rows"]}
    assert rows["vanilla/b"]["status"] == "error" and "boom" in rows["vanilla/b"]["reason"]
    assert rows["vanilla/c"]["status"] == "oom"
    assert (rows["vanilla/d"]["status"], rows["vanilla/d"]["reason"]) == ("skipped", "not here")
    assert rows["vanilla/e"]["status"] == "skipped"
    assert "--part vanilla --rows 'vanilla/e'" in rows["vanilla/e"]["reason"]
    assert "RuntimeError: boom" in open(rf.log_path).read()  # the traceback is in the log

    again = _run_file(tool, tmp_path, "--rows", "vanilla/[ab]")  # a second call appends
    ran = []
    again.row("vanilla", "vanilla/a", "eager", lambda: ran.append("a") or {})
    again.row("vanilla", "vanilla/b", "eager", lambda: {"kind": "check", "check": "b",
                                                        "passed": True, "details": {}})
    again.row("vanilla", "vanilla/c", "eager", lambda: ran.append("c") or {})
    doc = gpu_runs.load(again.path)
    assert ran == [] and len(doc["argv"]) == 2  # ok rows are kept, filtered rows not run
    assert {r["id"]: r["status"] for r in doc["rows"]}["vanilla/b"] == "ok"
    assert len(doc["rows"]) == 5


def torch_oom():
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_missing_fast_path_switches_skip_their_rows_and_defaults_need_none():
    tool = load_tool("gpu_bench")
    none = dict.fromkeys(tool.FAST_PATHS, False) | {"train.compile": True}
    assert tool.settings_overrides(tool.MODE_SETTINGS["eager"], none) == ["train.compile=false"]
    with pytest.raises(tool.Skip, match="train.cuda_graphs does not exist"):
        tool.settings_overrides(tool.MODE_SETTINGS["compiled+graphs"], none)
    every = dict.fromkeys(tool.FAST_PATHS, True)
    assert tool.settings_overrides({**tool.MODE_SETTINGS["compiled"], **tool.UNFUSED},
                                   every) == [
        "train.compile=true", "train.cuda_graphs=false", "train.fused_cross_entropy=false",
        "train.fused_optimizer=false"]
    names = tool.train_options()
    assert names["train.compile"] is True and set(names) == set(tool.FAST_PATHS)


def test_kernel_names_fall_into_the_profile_categories():
    import re

    tool = load_tool("gpu_bench")
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT": "gemm",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>": "attention",
        "_moda_bwd_dq_kernel": "attention",
        "depth_mix_fwd_kernel": "depth_kernels", "mhc_read_bwd_x_kernel": "depth_kernels",
        "void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor>":
            "optimizer",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
        "Memcpy DtoH (Device -> Pinned)": "memcpy",
        "triton_poi_fused_add_mul_0": "elementwise",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>": "elementwise",
        "some_other_kernel": "other",
    }
    for name, category in names.items():
        got = next((c for c, rule in tool.PROFILE_RULES if re.search(rule, name.lower())),
                   "other")
        assert got == category, name
    assert set(c for c, _ in tool.PROFILE_RULES) | {"other"} == set(gpu_runs.CATEGORIES)


def test_the_run_file_name_and_json_are_what_the_docs_commit(tmp_path):
    tool = load_tool("gpu_bench")
    rf = _run_file(tool, tmp_path)
    stem = os.path.basename(rf.path)[:-5]
    assert stem.endswith("-cpu-0123456789") and stem[:4].isdigit()
    assert json.load(open(rf.path))["smoke"] is True
