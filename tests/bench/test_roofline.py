"""Roofline floors (``depthmix/bench/roofline.py``): counts checked against tensors
listed by hand, bounds, and one forward and one backward per full benchmark shape."""

from __future__ import annotations

import pytest

from depthmix import bench, kernels
from depthmix.bench import roofline
from depthmix.mixers import available
from depthmix.planning.hardware import H100, H200


def _find(work, op, case, direction):
    return next(w for w in work if w.op == op and w.case == case and w.direction == direction)


def test_depth_mix_bytes_are_each_tensor_once():
    t, heads, ng, d = 4096, 16, 4, 128
    query, kv_head = t * heads * d * 2, t * ng * d * 2
    work = bench.hooks("depth_mix").roofline_work()
    fwd = _find(work, "depth_mix", "T4096-G4-hd128", "fwd")
    # q, k, v, 2 source keys, 2 source values -> mixed value, fp32 lse
    assert fwd.bytes == query + 6 * kv_head + kv_head + t * ng * 4
    bwd = _find(work, "depth_mix", "T4096-G4-hd128", "bwd")
    # the same inputs, lse and the value gradient -> gradients of all 7 inputs
    assert bwd.bytes == 2 * (query + 6 * kv_head) + t * ng * 4 + kv_head


def test_moda_counts_causal_and_depth_pairs():
    t, heads, d, depth = 65536, 16, 128, 48
    work = bench.hooks("moda_attention").roofline_work()
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
    from depthmix.bench import attnres as attnres_bench
    from depthmix.bench import ddl as ddl_bench
    from depthmix.bench import depth_mix as depth_mix_bench
    from depthmix.bench import mhc as mhc_bench
    from depthmix.bench import moda_attention as moda_bench

    expected = {
        "depth_mix": len(depth_mix_bench.shapes(False)),
        "moda_attention": len(moda_bench.shapes(False)) + len(moda_bench.paper_shapes()),
        "attnres": len(attnres_bench.shapes(False)),
        "mhc": 3 * len(mhc_bench.shapes(False)),  # sinkhorn, read, post_res
        "ddl": 2 * len(ddl_bench.shapes(False)),  # read, write
    }
    work = roofline.all_work()
    assert set(expected) == set(kernels.ops())
    for op, cases in expected.items():
        ours = [w for w in work if w.op == op]
        assert len({w.case for w in ours}) == cases
        assert sorted(w.direction for w in ours) == ["bwd"] * cases + ["fwd"] * cases


# ---------------------------------------------------------------------------------------
# A whole step: what each mixer adds (issue 37)
# ---------------------------------------------------------------------------------------

MIXERS = [name for name in available() if name != "vanilla"]


def _run(mixer: str, *extra):
    from depthmix.config.load import compose_run

    return compose_run("model=tiny", f"mixer={mixer}", "train.micro_batch_size=2",
                       "train.global_batch_size=2", "train.precision=bf16", *extra)


def test_vanilla_adds_nothing_and_every_mixer_adds_something():
    vanilla = _run("vanilla")
    assert roofline.mixer_step_work(vanilla, 256) == []
    assert roofline.step_extra_floor(vanilla).seconds == 0
    for mixer in MIXERS:
        floor = roofline.step_extra_floor(_run(mixer), H100)
        assert floor.seconds > 0 and floor.ops, mixer
        assert all(o["fwd_s"] > 0 and o["bwd_s"] > 0 for o in floor.ops.values()), mixer


def test_depth_attn_step_is_one_depth_mix_per_layer_with_sources_counted_by_hand():
    """Tiny preset: 4 layers, hidden 128, 4 heads of 32, 2 KV heads; default stride 2
    (half the depth), anchored: layer 1 reads {0}, 2 reads {0}, 3 reads {0, 2}. One
    micro-batch of 2 x 128 tokens. Forward bytes of a layer with S sources: q, k, v, S
    source keys and values in, the mixed value and an fp32 lse per (token, KV head) out."""
    run = _run("depth_attn")
    t, heads, ng, d = 2 * 128, 4, 2, 32
    work = roofline.mixer_step_work(run, t)
    fwd = [w for w in work if w.direction == "fwd"]
    assert [w.case for w in fwd] == ["layer 1", "layer 2", "layer 3"]
    q, kv = 2 * t * heads * d, 2 * t * ng * d
    for w, s in zip(fwd, (1, 1, 2)):
        assert w.op == "depth_mix"
        assert w.bytes == q + (2 + 2 * s) * kv + kv + 4 * t * ng
    floor = roofline.step_extra_floor(run, H100)
    by_hand = sum(w.floor(H100)[0] for w in work)
    assert floor.seconds == pytest.approx(by_hand)
    assert floor.ops["depth_mix"]["calls"] == 3


def test_denseformer_step_counts_each_dwa_by_hand():
    """Every block has a DWA (period 1, dilation 1): block i averages its i + 1 outputs
    X_0..X_i (d = 128, bf16). Forward reads them and writes the average, 2 d FLOPs per
    source; backward reads dY and the sources, writes their gradients, twice the FLOPs."""
    run = _run("denseformer")
    t, h = 256, 128
    work = roofline.mixer_step_work(run, t)
    for i in range(1, 5):
        fwd, bwd = [w for w in work if w.case == f"block {i}"]
        s = i + 1
        assert (fwd.bytes, fwd.fp32_flops) == (2 * t * h * (s + 1), 2 * t * h * s)
        assert (bwd.bytes, bwd.fp32_flops) == (2 * t * h * (1 + 2 * s), 4 * t * h * s)
        assert fwd.floor(H100) == (pytest.approx(fwd.bytes / 3.35e12), "memory")


def test_moda_step_is_the_depth_part_of_the_attention_and_the_projections():
    """MoDA's extra over the plain attention of a layer reading D entries: their keys and
    values (2 bf16 x T x H_kv x d x D) and 4 d H T D tensor FLOPs forward; plus one
    h x 2 H_kv d_h GEMM per projected MLP entry (every layer's but the last: 3)."""
    run = _run("moda")
    t, heads, ng, d, h = 256, 4, 2, 32, 128
    work = roofline.mixer_step_work(run, t)
    layer = [w for w in work if w.op == "moda depth entries" and w.direction == "fwd"]
    for w in layer:
        depth = 2 * int(w.case.split()[1])  # attention and MLP entries of earlier layers
        assert w.bytes == 2 * t * ng * d * 2 * depth
        assert w.tensor_flops == 4 * d * heads * t * depth
    projections = [w for w in work if w.op == "moda kv projection" and w.direction == "fwd"]
    assert len(projections) == 3
    assert projections[0].tensor_flops == 2 * t * h * 2 * ng * d


def test_step_floor_scales_with_micro_batches_and_tokens():
    one = roofline.step_extra_floor(_run("mhc"), H100)
    four = roofline.step_extra_floor(_run("mhc", "train.global_batch_size=8"), H100)
    assert four.micro_batches == 4 and four.seconds == pytest.approx(4 * one.seconds)
    longer = roofline.step_extra_floor(_run("mhc", "train.micro_batch_size=4",
                                            "train.global_batch_size=4"), H100)
    assert longer.seconds == pytest.approx(2 * one.seconds, rel=0.02)  # memory-bound
    assert roofline.step_extra_floor(_run("mhc"), H200).seconds < one.seconds
    assert set(one.as_dict()["ops"]) == {"mhc read", "mhc post/res", "mhc stem/head"}
