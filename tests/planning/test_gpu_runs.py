"""GPU run files as the planner reads them (``depthmix/planning/gpu_runs.py``): the schema,
the step-time constants refitted to measured vanilla steps (a synthetic run made with known
constants gives them back, and they reach the planner), and ``depthmix-plan`` printing the
measured step beside its prediction."""

from __future__ import annotations

import copy
import io
import json

import pytest

from depthmix.cli.plan import main as plan_main
from depthmix.config.load import compose_run
from depthmix.mixers import get_mixer
from depthmix.planning import gpu_runs, step_time
from depthmix.planning import planner as plan
from depthmix.planning.flops import flops_per_token
from depthmix.planning.hardware import H100

MFU, HALF_WORK, STAGE = 0.35, 3.0e9, 4.0e-4
"""The constants the synthetic run is made with."""


def _model(run) -> dict:
    m = run.model
    return {"preset": m.name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "ffn_hidden_size": m.ffn_hidden_size, "num_attention_heads": m.num_attention_heads,
            "num_query_groups": m.num_query_groups, "kv_channels": m.kv_channels,
            "seq_length": m.seq_length, "vocab_size": m.padded_vocab_size}


def _step_row(run, ms: float, mode: str = "compiled") -> dict:
    mb, seq = run.train.micro_batch_size, run.model.seq_length
    return {"part": "vanilla", "id": f"vanilla/{run.model.name}-h{run.model.hidden_size}/"
                                      f"mb{mb}/{mode}",
            "status": "ok", "reason": None, "seconds": 1.0, "kind": "step",
            "model": _model(run), "mixer": "vanilla", "impl": None, "mixer_options": {},
            "mode": mode, "micro_batch": mb, "precision": run.train.precision, "settings": {},
            "params": 1, "steps": 4, "ms_per_step": ms, "tokens_per_s": mb * seq / ms * 1e3,
            "flops_per_token": flops_per_token(run, get_mixer("vanilla"))["train"],
            "flops_per_token_causal": 1.0,
            "peak_tflops": H100.tflops["bf16"], "mfu": 0.3, "mfu_causal": 0.25,
            "peak_memory_gib": 10.0, "profile": None}


def synthetic_run_file(shapes) -> dict:
    """A run file whose compiled vanilla steps follow the step-time model exactly at
    :data:`MFU`, :data:`HALF_WORK`, :data:`STAGE` (one GPU, one micro-batch a step)."""
    rows, composed = [], {}
    for preset, mb in shapes:
        if preset not in composed:
            composed[preset] = compose_run(f"model={preset}", "model.num_layers=4",
                                           "train.precision=bf16")
        run = copy.deepcopy(composed[preset])
        run.train.micro_batch_size = run.train.global_batch_size = mb
        m = run.model
        tokens, work = mb * m.seq_length, mb * m.seq_length * m.hidden_size ** 2
        flops = flops_per_token(run, get_mixer("vanilla"))["train"]
        compute = flops * tokens / (H100.tflops["bf16"] * 1e12 * MFU)
        seconds = compute * (1 + HALF_WORK / work) + STAGE
        rows.append(_step_row(run, seconds * 1e3))
    env = {k: None for k in gpu_runs.ENVIRONMENT_KEYS}
    env.update(device="NVIDIA H100 80GB HBM3", device_kind="h100", device_table=H100.name,
               peak_tflops=H100.tflops["bf16"], torch="2.11.0", triton="3.6.0",
               git_commit="0123456789abcdef", git_dirty=False)
    return {"schema": gpu_runs.SCHEMA, "tool": "tools/gpu_bench.py", "date": "2026-12-01",
            "started": "2026-12-01T00:00:00+00:00", "argv": [[]], "smoke": False,
            "environment": env, "options": {}, "parts": {"vanilla": {"status": "done"}},
            "rows": rows}


SHAPES = [("1p5b", 1), ("1p5b", 2), ("1p5b", 4), ("3b", 1), ("3b", 2)]


@pytest.fixture(scope="module")
def synthetic():
    return synthetic_run_file(SHAPES)


def test_a_run_file_validates_and_the_schema_names_what_is_missing(synthetic):
    assert gpu_runs.validate(synthetic) == []
    broken = json.loads(json.dumps(synthetic))
    del broken["environment"]["git_commit"]
    del broken["rows"][0]["ms_per_step"]
    broken["rows"][1]["status"] = "error"  # without a reason
    broken["rows"][2]["mode"] = "fast"
    problems = gpu_runs.validate(broken)
    assert "environment: no 'git_commit'" in problems
    assert any("no 'ms_per_step'" in p for p in problems)
    assert any("needs a reason" in p for p in problems)
    assert any("mode 'fast'" in p for p in problems)


def test_fit_recovers_the_constants_the_steps_were_made_with(synthetic):
    rows = gpu_runs.calibration_rows([synthetic])[H100.name]
    fit = gpu_runs.fit(rows)
    assert fit["mfu"] == pytest.approx(MFU, rel=1e-6)
    assert fit["gemm_half_work"] == pytest.approx(HALF_WORK, rel=1e-6)
    assert fit["stage_seconds"] == pytest.approx(STAGE, rel=1e-5)
    assert fit["max_rel_error"] < 1e-9 and fit["rows"] == len(SHAPES)
    with pytest.raises(ValueError, match="at least 3"):
        gpu_runs.fit(rows[:2])


def test_fitted_constants_reach_the_planner(synthetic, tmp_path, monkeypatch):
    """Written to the fit file, read back by the step-time model and the GPU kind: the
    planner then predicts the synthetic steps exactly; ``cluster.mfu=`` still wins."""
    monkeypatch.setattr(gpu_runs, "FIT_FILE", tmp_path / "fit.json")
    assert step_time.constants(H100.name) == step_time.Constants()  # nothing fitted yet
    gpu_runs.write_fit([synthetic], ["synthetic"])
    c = step_time.constants(H100.name)
    assert (c.mfu, c.gemm_half_work) == (pytest.approx(MFU), pytest.approx(HALF_WORK))
    assert plan.Cluster(gpus=1, gpu="h100").kind().mfu == pytest.approx(MFU)
    assert plan.Cluster(gpus=1, gpu="h100", mfu=0.5).kind().mfu == 0.5
    assert plan.Cluster(gpus=1, gpu="a100").kind().mfu == 0.52  # no A100 run: the default
    row = synthetic["rows"][1]
    run = compose_run("model=1p5b", "model.num_layers=4", "train.precision=bf16",
                      "train.micro_batch_size=2", "train.global_batch_size=2")
    lay = plan.Layout(1, 1, None, 1, 2, "none", False, False)
    predicted = plan.evaluate(run, get_mixer("vanilla"), lay,
                              plan.Cluster(gpus=1, gpu="h100")).step_seconds
    assert predicted * 1e3 == pytest.approx(row["ms_per_step"], rel=1e-6)


def test_plan_prints_the_measured_step_beside_its_prediction(synthetic, tmp_path,
                                                            monkeypatch):
    """A run file with the planned shape (in ``$DEPTHMIX_GPU_RUNS``): one line with the
    measured ms/step, the run file and the prediction for that layout; none for a shape
    or a cluster it did not measure."""
    monkeypatch.setattr(gpu_runs, "FIT_FILE", tmp_path / "no_fit.json")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "2026-12-01-h100-0123456789.json").write_text(json.dumps(synthetic))
    monkeypatch.setenv(gpu_runs.RUNS_ENV, str(runs))
    args = ["model=1p5b", "model.num_layers=4", "train.precision=bf16",
            "train.global_batch_size=2", "cluster.gpus=1", "cluster.gpu=h100"]
    out = io.StringIO()
    assert plan_main(args, out=out) == 0
    lines = [x for x in out.getvalue().splitlines() if x.startswith("measured:")]
    ms = synthetic["rows"][1]["ms_per_step"]
    assert len(lines) == 1, out.getvalue()
    assert lines[0].startswith(f"measured: tp1 pp1 dp1 mb2 compiled on NVIDIA H100 80GB "
                               f"HBM3: {ms:.1f} ms a step")
    assert "run file 2026-12-01-h100-0123456789" in lines[0] and "predicted" in lines[0]
    for other in (["train.global_batch_size=8"], ["cluster.gpus=2"], ["cluster.gpu=h200"],
                  ["train.compile=false"], ["model.num_layers=8"],
                  ["model.moe.num_experts=4", "model.moe.top_k=1",  # experts: not the dense row
                   "model.moe.normalize_top_k=false", "model.moe.ffn_hidden_size=4096"]):
        out = io.StringIO()
        assert plan_main([*args, *other], out=out) == 0
        assert "measured:" not in out.getvalue(), other
