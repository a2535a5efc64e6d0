"""Every kernel op has its benchmark module in ``depthmix/bench/<op>.py`` with the hooks the
benchmark, roofline and GPU-compile lists read."""

import importlib

import pytest

from depthmix import bench, kernels


@pytest.mark.parametrize("op", kernels.ops())
def test_every_kernel_op_has_its_bench_hooks(op):
    module = bench.hooks(op)
    assert all(callable(getattr(module, hook)) for hook in bench.HOOKS)


def test_an_op_without_a_bench_hook_is_named(monkeypatch):
    module = importlib.import_module("depthmix.bench.mhc")
    monkeypatch.delattr(module, "roofline_work")
    with pytest.raises(AttributeError, match="kernel op 'mhc' .* has no roofline_work"):
        bench.hooks("mhc")
