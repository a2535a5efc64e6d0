"""tools/bench_kernels.py: ``--check`` (the kernels' numerics at the benchmark shapes, what
a GPU run prints) measures what it says."""

import pytest

from depthmix import kernels
from depthmix.kernels.dispatch import triton_status
from tools_modules import load_tool


@pytest.mark.skipif(not triton_status()[0], reason=triton_status()[1])
def test_check_reports_ours_against_the_fp32_reference():
    """The interpreter's kernel is at fp32 accuracy; a kernel 1 % off is reported as such."""
    tool = load_tool("bench_kernels")
    case = kernels.bench("depth_mix").cases(smoke=True)[0]
    outputs, grads, n = tool.check(case)
    assert n == 7 and max(outputs, grads) < 1e-5, (outputs, grads, n)

    torch_path = case.candidates["torch"]
    case.candidates["ours"] = lambda *a, **k: torch_path(*a, **k) * 1.01
    outputs, grads, _ = tool.check(case)
    assert min(outputs, grads) > 5e-3, (outputs, grads)
