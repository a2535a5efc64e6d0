"""Roofline floors (``depthmix/kernels/roofline.py``): counts checked against tensors
listed by hand, bounds, and one forward and one backward per full benchmark shape."""

from __future__ import annotations

import pytest

from depthmix import kernels
from depthmix.kernels import roofline
from depthmix.planning.hardware import H100, H200


def _find(work, op, case, direction):
    return next(w for w in work if w.op == op and w.case == case and w.direction == direction)


def test_depth_mix_bytes_are_each_tensor_once():
    t, heads, ng, d = 4096, 16, 4, 128
    query, kv_head = t * heads * d * 2, t * ng * d * 2
    work = kernels.bench("depth_mix").roofline_work()
    fwd = _find(work, "depth_mix", "T4096-G4-hd128", "fwd")
    # q, k, v, 2 source keys, 2 source values -> mixed value, fp32 lse
    assert fwd.bytes == query + 6 * kv_head + kv_head + t * ng * 4
    bwd = _find(work, "depth_mix", "T4096-G4-hd128", "bwd")
    # the same inputs, lse and the value gradient -> gradients of all 7 inputs
    assert bwd.bytes == 2 * (query + 6 * kv_head) + t * ng * 4 + kv_head


def test_moda_counts_causal_and_depth_pairs():
    t, heads, d, depth = 65536, 16, 128, 48
    work = kernels.bench("moda_attention").roofline_work()
    fwd = _find(work, "moda_attention", "T65536-G8-hd128-D48", "fwd")
    pairs = heads * (t * (t + 1) / 2 + t * depth)
    assert fwd.tensor_flops == 4 * d * pairs
    bwd = _find(work, "moda_attention", "T65536-G8-hd128-D48", "bwd")
    assert bwd.tensor_flops == 2.5 * fwd.tensor_flops
    assert fwd.floor(H100)[1] == bwd.floor(H100)[1] == "tensor"
    assert fwd.floor(H100)[0] == pytest.approx(fwd.tensor_flops / 989.4e12)


def test_bounds_and_devices():
    work = roofline.all_work()
    for w in work:
        if w.op in ("depth_mix", "attnres") or w.case.startswith(("read", "post_res")):
            assert w.floor(H100)[1] == "memory", (w.op, w.case, w.direction)
        assert w.floor(H200)[0] <= w.floor(H100)[0]
        assert w.bytes > 0 and w.flops > 0


def test_one_forward_and_backward_per_full_benchmark_shape():
    from depthmix.kernels.attnres import bench as attnres_bench
    from depthmix.kernels.depth_mix import bench as depth_mix_bench
    from depthmix.kernels.mhc import bench as mhc_bench
    from depthmix.kernels.moda_attention import bench as moda_bench

    expected = {
        "depth_mix": len(depth_mix_bench.shapes(False)),
        "moda_attention": len(moda_bench.shapes(False)) + len(moda_bench.paper_shapes()),
        "attnres": len(attnres_bench.shapes(False)),
        "mhc": 3 * len(mhc_bench.shapes(False)),  # sinkhorn, read, post_res
    }
    work = roofline.all_work()
    assert set(expected) == set(kernels.ops())
    for op, cases in expected.items():
        ours = [w for w in work if w.op == op]
        assert len({w.case for w in ours}) == cases
        assert sorted(w.direction for w in ours) == ["bwd"] * cases + ["fwd"] * cases
