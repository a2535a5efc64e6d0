"""tools/bench_kernels.py: ``--check`` (the kernels' numerics at the benchmark shapes, what
a GPU run prints) measures what it says."""

import pytest

from depthmix import bench
from depthmix.kernels.dispatch import triton_status
from tools_modules import load_tool


@pytest.mark.skipif(not triton_status()[0], reason=triton_status()[1])
def test_check_reports_ours_against_the_fp32_reference():
    """The interpreter's kernel is at fp32 accuracy; a kernel 1 % off is reported as such."""
    tool = load_tool("bench_kernels")
    case = bench.hooks("depth_mix").cases(smoke=True)[0]
    outputs, grads, n = tool.check(case)
    assert n == 7 and max(outputs, grads) < 1e-5, (outputs, grads, n)

    torch_path = case.candidates["torch"]
    case.candidates["ours"] = lambda *a, **k: torch_path(*a, **k) * 1.01
    outputs, grads, _ = tool.check(case)
    assert min(outputs, grads) > 5e-3, (outputs, grads)


def test_profile_prints_where_the_time_goes_and_writes_a_trace(tmp_path, capsys):
    """``--profile``: the wall and host time per call, the operators by host time (the
    reference's own ops appear), and a Chrome trace that holds them."""
    import json

    tool = load_tool("bench_kernels")
    case = bench.hooks("mhc").cases(smoke=True)[0]  # Sinkhorn, the reference path
    tool.profile("sinkhorn torch", case.candidates["torch"], case.make_inputs, iters=2,
                 trace_dir=str(tmp_path), rep_ms=10)
    out = capsys.readouterr().out
    assert "sinkhorn torch: wall" in out and "(2 calls)" in out, out
    assert "aten::div" in out, out  # Sinkhorn's normalisations, forward and backward
    trace = json.loads((tmp_path / "sinkhorn_torch.json").read_text())
    assert any(e.get("name") == "aten::div" for e in trace["traceEvents"])
