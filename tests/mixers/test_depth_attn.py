"""Depth-Attention (``mixer=depth_attn``): the paper's loops vs the vectorised model, its
invariants, the KV cache's mixed values, the plan and config validation.
(Decoding and recomputation: test_conformance.py.)"""

import itertools
import math

import pytest
import torch

from depthmix.config.schema import ConfigError
from depthmix.config.validate import validate
from depthmix.kernels.depth_mix import depth_mix_reference, depth_weights
from depthmix.mixers.depth_attn import (
    MIX_RULES,
    MIXED_STATES,
    SOURCE_MODES,
    DepthSchedule,
    depth_attn_plan,
    depth_sources,
    extra_flops_per_token,
    key_name,
    value_name,
)
from depth_attn_reference import reference_logits, reference_sources
from depthmix.testing import build_model, tiny_run

SEQ = 8
TOL = dict(rtol=1e-10, atol=1e-10)


def make_run(mixer="depth_attn", *, groups=2, layers=4, n_loops=1, **options):
    """tiny_run (4 layers, 4 query heads, hidden 64) with ``groups`` KV heads (2: GQA G=2,
    4: MHA) and the stride re-resolved for the final depth unless given."""
    run = tiny_run(mixer, **options)
    m = run.model
    m.num_query_groups, m.num_layers, m.n_loops = groups, layers, n_loops
    if mixer == "depth_attn" and "stride" not in options:
        run.mixer.stride = None
        run.mixer.resolve(m)
    return run


def grads_of(model, input_ids, logits_fn, weight):
    model.zero_grad()
    logits = logits_fn(input_ids)
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- 1. the paper's loops vs the vectorised model, fp64, every switch ------------------------
STRIDES = {"anchored": (1, 2, 6), "relative": (1, 2, 3)}  # anchored 6 >= depth: first layer only
CASES = [
    pytest.param(mode, rule, state, groups, stride,
                 id=f"{mode}-{rule}-{state}-{'mha' if groups == 4 else 'gqa'}-s{stride}")
    for mode, rule, state in itertools.product(SOURCE_MODES, MIX_RULES, MIXED_STATES)
    for groups in (2, 4)
    for stride in STRIDES[mode]
]


def check_against_reference(run, seed=0):
    torch.manual_seed(seed)
    model = build_model(run, dtype=torch.float64)
    ids = torch.randint(0, run.model.vocab_size, (2, SEQ))
    weight = torch.randn(2, SEQ, model.vocab_size, dtype=torch.float64)
    out, grads = grads_of(model, ids, model, weight)
    ref, ref_grads = grads_of(model, ids, lambda x: reference_logits(model, x), weight)
    torch.testing.assert_close(out, ref, **TOL)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mode, rule, state, groups, stride", CASES)
def test_matches_paper_reference(mode, rule, state, groups, stride, megatron_single):
    run = make_run(groups=groups, stride=stride, source_mode=mode, mix_rule=rule,
                   mixed_state=state)
    check_against_reference(run)


@pytest.mark.parametrize("mode", SOURCE_MODES)
@pytest.mark.parametrize("state", ["value", "key_value"])
@pytest.mark.parametrize("own_loops", [True, False], ids=["own-loops", "stride-only"])
def test_looped_matches_paper_reference(mode, state, own_loops, megatron_single):
    """Three loops of a 2-layer stack: sources index the unrolled depth 6 (default stride 3:
    anchored layers 0 and 3 are sources); with ``own_loops`` a shared layer also mixes the
    values it produced at its own earlier loops (the paper's looped Depth-Attention)."""
    run = make_run(layers=2, n_loops=3, source_mode=mode, mixed_state=state, own_loops=own_loops)
    assert run.mixer.stride == 3
    schedule = DepthSchedule.from_config(build_model(run).config)
    for u in range(6):
        own = {j for j in range(u) if j % 2 == u % 2}
        stride_only = set(depth_sources(u, 3, mode))
        assert set(schedule.sources(u)) == (stride_only | own if own_loops else stride_only), u
    check_against_reference(run)


def test_looped_own_loop_sources():
    """Layer 5 of a 2-layer stack looped 3 times is stored layer 1 at loop 2: its earlier
    runs are unrolled layers 1 and 3; the stride-3 anchored sources add 0 and 3."""
    assert depth_sources(5, 3, "anchored", loop_period=2) == (0, 1, 3)
    assert depth_sources(5, 3, "relative", loop_period=2) == (1, 2, 3)
    assert depth_sources(5, 3, "anchored") == (0, 3)
    for layer in range(12):
        assert list(depth_sources(layer, 4, "relative", 3)) == \
            reference_sources(layer, 4, "relative", 3)


# ---- 2. invariants ----------------------------------------------------------------------
def test_adds_no_parameters(megatron_single):
    vanilla = build_model(make_run("vanilla"), dtype=torch.float64)
    depth = build_model(make_run(stride=1), dtype=torch.float64)
    v = {n: p for n, p in vanilla.named_parameters()}
    d = {n: p for n, p in depth.named_parameters()}
    assert list(v) == list(d)
    for name in v:
        assert torch.equal(v[name], d[name]), name  # same seed: same weights


def _layer_outputs(model, ids):
    hidden = {}
    hooks = [layer.register_forward_hook(
        lambda mod, args, out, i=i: hidden.__setitem__(i, out["h"].clone()))
        for i, layer in enumerate(model.decoder.layers)]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return hidden


@pytest.mark.parametrize("groups", [2, 4])
def test_layer0_is_vanilla(groups, megatron_single):
    vanilla = build_model(make_run("vanilla", groups=groups), dtype=torch.float64)
    depth = build_model(make_run(groups=groups, stride=1), dtype=torch.float64)
    ids = torch.randint(0, 128, (2, SEQ))
    hv, hd = _layer_outputs(vanilla, ids), _layer_outputs(depth, ids)
    assert torch.equal(hv[0], hd[0])  # layer 0 has no source: bit-identical
    assert (hv[1] - hd[1]).abs().max() > 1e-6  # layer 1 mixes over layer 0


def test_uniform_is_plain_mean():
    torch.manual_seed(0)
    s, b, ng, G, hn, S = 5, 2, 2, 3, 8, 3
    q = torch.randn(s, b, ng * G, hn, dtype=torch.float64)
    k, v = torch.randn(2, s, b, ng, hn, dtype=torch.float64)
    src_k = torch.randn(S, s, b, ng, hn, dtype=torch.float64)
    src_v = torch.randn(S, s, b, ng, hn, dtype=torch.float64)
    key, value = depth_mix_reference(q, k, v, None, src_v, mix_rule="uniform")
    torch.testing.assert_close(value, (v + src_v.sum(0)) / (S + 1), **TOL)
    assert key is k
    key, value = depth_mix_reference(q, k, v, src_k, src_v, mix_rule="uniform",
                                     mixed_state="key_value")
    torch.testing.assert_close(key, (k + src_k.sum(0)) / (S + 1), **TOL)
    torch.testing.assert_close(value, (v + src_v.sum(0)) / (S + 1), **TOL)


def test_op_boundary_stacked_buffer_list_and_dtypes():
    """A stacked buffer and a list give the same result; 16-bit inputs get fp32 weights."""
    torch.manual_seed(0)
    s, b, ng, G, hn, S = 4, 2, 2, 2, 8, 2
    q = torch.randn(s, b, ng * G, hn)
    k, v = torch.randn(2, s, b, ng, hn)
    buf_k, buf_v = torch.randn(2, S + 1, s, b, ng, hn)  # one slot too many: a view of a buffer
    for state in MIXED_STATES:
        a = depth_mix_reference(q, k, v, buf_k[:S], buf_v[:S], mixed_state=state)
        c = depth_mix_reference(q, k, v, list(buf_k[:S]), list(buf_v[:S]), mixed_state=state)
        for x, y in zip(a, c):
            assert torch.equal(x, y)
    w = depth_weights(q.bfloat16(), k.bfloat16(), buf_k[:S].bfloat16())
    assert w.dtype == torch.float32 and w.shape == (s, b, ng, S + 1)
    torch.testing.assert_close(w.sum(-1), torch.ones(s, b, ng))
    _, value = depth_mix_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), buf_k[:S].bfloat16(),
                         buf_v[:S].bfloat16())
    assert value.dtype == torch.bfloat16
    ref = depth_mix_reference(q, k, v, buf_k[:S], buf_v[:S])[1]
    torch.testing.assert_close(value.float(), ref, rtol=2e-2, atol=2e-2)


def test_looped_model_has_one_stack_of_parameters(megatron_single):
    one = build_model(make_run(layers=2, n_loops=1, stride=1))
    looped = build_model(make_run(layers=2, n_loops=3, stride=1))
    assert [(n, p.shape) for n, p in one.named_parameters()] == \
        [(n, p.shape) for n, p in looped.named_parameters()]
    # ... while the depth state spans the unrolled depth 6 (sources 0..4)
    assert {key_name(j) for j in range(5)} <= set(looped.plan.entries)


# ---- 3. the KV cache holds mixed values ------------------------------------------------
def test_v_cache_holds_mixed_values(megatron_single):
    from depthmix.inference import KVCache

    model = build_model(make_run(stride=1), dtype=torch.float64).eval()
    cache = KVCache()
    ids = torch.randint(0, 128, (2, SEQ))
    stored = {}
    hook = model.decoder.layers[1].self_attention.depth_mixer.register_forward_hook(
        lambda mod, args, out: stored.update(key=args[1], value=args[2], out=out))
    with torch.no_grad():
        model(ids, inference=cache)
    hook.remove()
    assert torch.equal(cache.values[1], stored["out"][1])  # the mixed ṽ_1 ...
    assert not torch.allclose(cache.values[1], stored["value"])  # ... not the raw v_1
    assert torch.equal(cache.keys[1], stored["key"])  # keys untouched in value mode


# ---- sources, plan, pipeline bytes, statistics, cost ------------------------------------
def test_source_sets():
    assert [depth_sources(l, 2, "anchored") for l in range(6)] == \
        [(), (0,), (0,), (0, 2), (0, 2), (0, 2, 4)]
    assert [depth_sources(l, 2, "relative") for l in range(6)] == \
        [(), (), (0,), (1,), (0, 2), (1, 3)]
    assert all(depth_sources(l, 24, "anchored") == (0,) for l in range(1, 24))
    assert depth_sources(5, 1, "anchored") == depth_sources(5, 1, "relative") == tuple(range(5))
    for mode, stride, layer in itertools.product(SOURCE_MODES, range(1, 9), range(12)):
        assert list(depth_sources(layer, stride, mode)) == reference_sources(layer, stride, mode)


def _config(run):
    from depthmix.megatron_ext.config import to_transformer_config

    return to_transformer_config(run)


@pytest.mark.parametrize("rule, state, keys, values", [
    ("softmax", "value", True, True), ("uniform", "value", False, True),
    ("softmax", "key", True, False), ("uniform", "key", True, False),
    ("uniform", "key_value", True, True)])
def test_plan_is_exact(rule, state, keys, values):
    run = make_run(groups=4, layers=6, stride=2, mix_rule=rule, mixed_state=state)
    run.parallel.tp = 2
    config = _config(run)
    entries = {e.name: e for e in depth_attn_plan(config, tp=2)}
    assert entries.pop("h").seq_sharded
    expected = {}
    for j, readers in [(0, (1, 2, 3, 4, 5)), (2, (3, 4, 5)), (4, (5,))]:  # anchored, stride 2
        if keys:
            expected[key_name(j)] = readers
        if values:
            expected[value_name(j)] = readers
    assert {n: e.readers for n, e in entries.items()} == expected
    for j, e in ((int(n.split("/")[1][1:]), e) for n, e in entries.items()):
        assert e.writers == (j,) and e.shape == (2, 16) and not e.seq_sharded  # ng/tp, hn


@pytest.mark.parametrize("pp, stride, live", [(2, 1, {1: 2}), (4, 2, {1: 1, 2: 1, 3: 2}),
                                              (4, 4, {1: 1, 2: 1, 3: 1})])
def test_pipeline_bytes_formula(pp, stride, live):
    """Payload per transition = the residual stream + 2 * |live sources| * s * b * ng/tp * hn
    elements (docs/methods/depth_attn.md), straight from the plan. ``live``: chunk ->
    number of sources written before the chunk and read in or after it."""
    from depthmix.planning.pipeline import PipelineLayout, geometry_of

    run = make_run(stride=stride)
    run.parallel.pp = pp
    config = _config(run)
    geo = geometry_of(depth_attn_plan, config, PipelineLayout(4, pp), 1)
    b, e, s, ng, hn = 3, 2, 16, 2, 16
    for chunk, n in live.items():
        assert geo.payload_bytes(chunk, b, e) == (s * b * 64 + 2 * n * s * b * ng * hn) * e


def test_depth_weight_statistics(megatron_single):
    model = build_model(make_run(layers=4, stride=2)).eval()
    stats = {}
    with torch.no_grad():
        model(torch.randint(0, 128, (2, SEQ)), stats=stats)
    for layer in range(4):
        sources = stats[f"layer{layer}/depth_attn/sources"].tolist()
        weights = stats[f"layer{layer}/depth_attn/weights"]
        assert sources == [*depth_sources(layer, 2), layer]
        assert weights.shape == (len(sources),) and math.isclose(weights.sum().item(), 1.0,
                                                                 rel_tol=1e-5)
    assert not torch.allclose(stats["layer3/depth_attn/weights"], torch.full((3,), 1 / 3))


def test_extra_flops_3b():
    """The Depth-Attention paper B.2 counting at the 3B preset (48 layers, stride 24, 8 KV heads x
    64, G=4):
    layers 1-24 mix 1 source, 25-47 two; 4 (n+1) d_kv per layer plus the group mean d."""
    from depthmix.config.load import compose_run

    config = _config(compose_run("model=3b", "mixer=depth_attn"))
    d_kv, d = 8 * 64, 2048
    expected = 4 * d_kv * (24 * 2 + 23 * 3) + 47 * d
    assert extra_flops_per_token(config) == expected == 335_872


# ---- 4. configuration -------------------------------------------------------------------
@pytest.mark.parametrize("preset, stride", [("360m", 12), ("500m", 12), ("710m", 16),
                                            ("1p5b", 24), ("3b", 24)])
def test_default_stride_is_half_the_depth(preset, stride):
    from depthmix.config.load import compose_run

    run = compose_run(f"model={preset}", "mixer=depth_attn")
    assert run.mixer.stride == stride == run.model.num_layers // 2
    assert compose_run(f"model={preset}", "mixer=depth_attn", "mixer.stride=6").mixer.stride == 6
    looped = compose_run(f"model={preset}", "mixer=depth_attn", "model.n_loops=3")
    assert looped.mixer.stride == 3 * stride  # half the unrolled depth
    assert DepthSchedule(run.model.num_layers, stride).source_layers == (0, stride)


@pytest.mark.parametrize("options, option", [
    ({"stride": 0}, "mixer.stride=0"),
    ({"stride": -3}, "mixer.stride=-3"),
    ({"source_mode": "strided"}, "mixer.source_mode"),
    ({"mix_rule": "max"}, "mixer.mix_rule"),
    ({"mixed_state": "query"}, "mixer.mixed_state"),
    ({"source_mode": "relative", "stride": 4}, "mixer.stride=4"),
])
def test_bad_config_names_the_option(options, option):
    run = make_run(**options)
    with pytest.raises(ConfigError) as info:
        validate(run)
    assert option in str(info.value)


def test_single_layer_has_no_sources():
    with pytest.raises(ConfigError, match="mixer.stride"):
        validate(make_run(layers=1, stride=1))
