"""tools/bench_host.py: per-layer host time and ATen calls of each training-step phase, with
the Triton kernels' launches as no-ops."""

import time

import pytest
import torch

from depthmix.kernels.dispatch import triton_status
from tools_modules import load_tool, markdown_rows

needs_triton = pytest.mark.skipif(not triton_status()[0], reason=triton_status()[1])


@needs_triton
def test_the_counter_sees_inside_the_kernel_ops_on_both_entries():
    """The launcher's own allocations count whether the op runs as a custom op (one call
    more: the op itself) or through its autograd.Function; the launch does nothing."""
    from depthmix.kernels._common import custom_ops_in_eager
    from depthmix.kernels.mhc.function import mhc_read_triton

    tool = load_tool("bench_host")
    x, phi = torch.randn(3, 1, 4, 16), torch.randn(64, 24)
    alpha, bias = torch.full((3,), 0.01), torch.randn(24)
    counts = {}
    with tool.no_kernel_launches():
        for entry in ("function", "custom_op"):
            counter = tool.AtenCounter()
            with custom_ops_in_eager() if entry == "custom_op" else torch.no_grad(), counter:
                x_in, *_ = mhc_read_triton(x, phi, alpha, bias)
            counts[entry] = counter.ops
            assert not x_in.any()  # zero-filled, not computed
    empty = ("other", "aten.empty.memory_format")
    assert counts["function"][empty] == counts["custom_op"][empty] == 6  # the six outputs
    assert counts["custom_op"][("other", "depthmix.mhc_read_fwd.default")] == 1
    assert sum(counts["custom_op"].values()) == sum(counts["function"].values()) + 1


@needs_triton
def test_rows_per_phase_for_the_torch_and_the_kernel_path(megatron_single, tmp_path, monkeypatch):
    """Two layers, one timed and one counted step each: every phase has a time and calls,
    the kernel path's step stays finite with its launches skipped, the CPU shim is back
    afterwards, and the table compares each row with vanilla."""
    from torch.overrides import _get_current_function_mode

    monkeypatch.chdir(tmp_path)  # the trainers' output directories
    tool = load_tool("bench_host")
    args = tool.parse_args(["--layers", "2", "--steps", "1", "--warmup", "1"])
    shim = _get_current_function_mode()
    rows = tool.measure([("vanilla", "torch", False), ("mhc", "triton", False)], args)
    assert _get_current_function_mode() is shim
    for row in rows:
        assert all(row["host_us"][p] > 0 and row["aten_calls"][p] > 0 for p in tool.PHASES)
        assert row["loss"] == row["loss"]  # finite: the no-op launches zero their outputs
    vanilla, mhc = rows
    # mHC's read now takes the sublayer's norm inside its kernel (its forward can match
    # vanilla's count); its streams' parameters still add gradient and optimizer work
    assert sum(mhc["aten_calls"].values()) > sum(vanilla["aten_calls"].values())
    table = markdown_rows(tool.table(rows))
    assert len(table) == 3 and table[1][:3] == ["vanilla", "torch", "eager"]
    assert table[1][7] == table[1][12] == "1.00"  # vanilla's own ratios: host time, ATen calls


def test_compile_gain_reads_the_two_vanilla_rows():
    tool = load_tool("bench_host")
    rows = [dict(mixer="vanilla", mode=mode, host_us=dict(forward=f, backward=b))
            for mode, f, b in (("eager", 300.0, 500.0), ("compiled", 100.0, 200.0))]
    assert tool.compile_gain(rows).endswith("compiled 300 / eager 800 = 0.38")
    assert tool.compile_gain(rows[:1]) == ""


@needs_triton
def test_the_fills_time_is_taken_out_of_the_phase():
    """A no-op launch zero-fills its arguments (a GPU run has no such pass): its time goes
    to the FillTime, not to the phase the launch falls in."""
    from depthmix.kernels.ddl.triton import ddl_read_fwd_kernel

    tool = load_tool("bench_host")
    big = torch.ones(2 ** 24)
    with tool.no_kernel_launches() as fills:
        phases = tool.Phases(fills)
        timed = phases._wrap("forward", lambda: ddl_read_fwd_kernel[(1,)](big))
        timed()  # the first call's lazy imports
        phases.clear()
        cpu, wall = fills.cpu, fills.wall
        big.fill_(1.0)
        t0 = time.perf_counter()
        timed()
        total = time.perf_counter() - t0
    assert not big.any()  # filled
    cpu, wall = fills.cpu - cpu, fills.wall - wall
    assert cpu > 0 and wall > 0
    assert phases.cpu["forward"] < 0.5 * cpu  # CPU time: the machine's load barely moves it
    assert phases.wall["forward"] == pytest.approx(total - wall, abs=1e-3)
