"""depthmix-plan's console contract: --help describes the cluster options, a typo'd or bad
cluster option exits 2 naming the closest valid one, and the report states what it assumed
and warns when the global batch, not the cluster, decides the layout."""

import io
import os
import subprocess
import sys

import pytest

from depthmix.cli.plan import main as plan_main
from depthmix.planning import step_time
from depthmix.runtime import exit_codes


@pytest.mark.multiproc(at_once=1)
def test_help_exits_0_and_describes_every_cluster_option():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "depthmix.cli.plan", "--help"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    for option in ("gpus", "gpu", "nodes", "reserve_gib", "memory_gib", "peak_tflops", "mfu",
                   "nvlink_gbs", "network_gbs"):
        assert f"  cluster.{option}: " in done.stdout
    assert "cluster.gpus: int = 8" in done.stdout and "Exit status" in done.stdout


@pytest.mark.parametrize("arg, expected", [
    ("cluster.node=2", "did you mean 'cluster.nodes'?"),
    ("cluster.gpu=h10", "did you mean 'h100'?"),
    ("cluster.gpus=eight", "cluster.gpus='eight' is not an integer"),
    ("model.hiden_size=64", "did you mean 'model.hidden_size'?"),
])
def test_bad_option_exits_2_naming_the_closest(arg, expected, capsys):
    status = plan_main(["model=tiny", arg], out=io.StringIO())
    err = capsys.readouterr().err
    assert status == exit_codes.CONFIG_ERROR
    assert expected in err and len(err.strip().splitlines()) == 1


def test_report_states_assumptions_and_warns_about_the_default_batch():
    """The issue's command: model=3b mixer=moda on 64 GPUs with the default train preset
    (16 sequences a step)."""
    out = io.StringIO()
    assert plan_main(["model=3b", "mixer=moda", "cluster.gpus=64"], out=out) == 0
    text = out.getvalue()
    header = text.split("valid layouts")[0]
    for assumed in ("16 sequences a step (train.global_batch_size)", "2048 tokens",
                    "micro-batches tried: 1, 2, 4, 8", "precision: fp32", "MFU 0.47",
                    "4.0 GiB reserve", "parallel.overlap_grad_reduce"):
        assert assumed in header, assumed
    assert "warning: train.global_batch_size=16 is smaller than one micro-batch per " \
           "data-parallel rank" in header


def test_no_warning_when_the_batch_fills_every_data_parallel_rank():
    out = io.StringIO()
    assert plan_main(["model=tiny", "train.global_batch_size=64", "cluster.gpus=8"],
                     out=out) == 0
    assert "warning" not in out.getvalue()


@pytest.mark.parametrize("overlap", [False, True])
def test_notes_what_overlap_would_hide_when_it_is_off(overlap, monkeypatch):
    """Slow GPUs and links, small buckets: the data-parallel communication of the chosen
    layout is worth hiding, and the note says so only while overlap is off."""
    monkeypatch.setattr(step_time, "BUCKET_PARAMS", 10_000)
    monkeypatch.setattr(step_time, "BUCKET_PARAMS_PER_DP", 1)
    flags = [f"parallel.overlap_grad_reduce={str(overlap).lower()}",
             f"parallel.overlap_param_gather={str(overlap).lower()}"]
    out = io.StringIO()
    assert plan_main(["model=tiny", "train.global_batch_size=64", "cluster.gpus=8",
                      "cluster.peak_tflops=2", "cluster.nvlink_gbs=0.05", *flags],
                     out=out) == 0
    text = out.getvalue()
    assert ("note: parallel.overlap_grad_reduce=true parallel.overlap_param_gather=true "
            "would hide" in text) is not overlap
