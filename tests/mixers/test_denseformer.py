"""DenseFormer: the vectorised mixer against a slow reference from the paper's equations,
"at init equals vanilla" and the exactness of the plan. (Decoding and recomputation:
test_conformance.py.)"""

import pytest
import torch
from resop_reference import (
    context,
    embed,
    ids_for,
    lm_logits,
    loss_and_grads,
)

from depthmix.config.schema import ConfigError
from depthmix.config.validate import validate
from depthmix.planning.depth_plan import DepthPlan
from depthmix.mixers.denseformer import DWAGeometry
from depthmix.testing import build_model, tiny_run

F64 = torch.float64


def make(dtype=F64, mha=False, n_loops=1, post=False, mixer="denseformer",
         layers=4, **options):
    run = tiny_run(mixer, **options)
    run.model.num_layers = layers
    if mha:
        run.model.num_query_groups = run.model.num_attention_heads
    run.model.n_loops = n_loops
    if post:
        run.model.norm_position = "post"
    return build_model(run, dtype=dtype)


def perturb(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".post_layer.alpha." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def reference_logits(model, ids, dilation, period):
    """Paper Eq. (1): X_i = B_i(Y_{i-1}); Y_i = sum_{j <= i, j = i mod k} alpha_{i,j} X_j
    after blocks with i % p == 0 (Y_i = X_i elsewhere); Y_0 = X_0; logits from Y_L.
    The weighted sum is taken one token at a time."""
    seq = ids.shape[1]
    ctx = context(model, seq)
    xs = [embed(model, ids)]
    y = xs[0]

    def residual(op, x, out):
        h = x + out
        return op.post_norm(h) if op.post_norm is not None else h

    for i, (u, layer) in enumerate(model.decoder.unrolled(), start=1):
        ctx.layer = u
        h = residual(layer.attn_residual, y,
                     layer.self_attention(layer.input_layernorm(y), {}, ctx))
        out, _ = layer.mlp(layer.pre_mlp_layernorm(h))
        xs.append(residual(layer.mlp_residual, h, out))
        if i % period:
            y = xs[i]
            continue
        averaged = [j for j in range(i + 1) if (i - j) % dilation == 0]
        alpha = dict(zip(averaged, layer.post_layer.alpha[str(i)]))
        rows = []
        for t in range(seq):
            rows.append(torch.stack([sum(alpha[j] * xs[j][t, n] for j in averaged)
                                     for n in range(ids.shape[0])]))
        y = torch.stack(rows)
    return lm_logits(model, y)


OPTIONS = [(k, p) for k in (1, 2, 3) for p in (1, 2, 3)]


@pytest.mark.parametrize("dilation,period", OPTIONS, ids=[f"k{k}xp{p}" for k, p in OPTIONS])
def test_matches_slow_reference_fp64(megatron_single, dilation, period):
    model = perturb(make(dilation=dilation, period=period, layers=6))
    _compare_with_reference(model, dilation, period)


@pytest.mark.parametrize("variant", ["mha", "post_norm", "loops2"])
def test_matches_slow_reference_variants(megatron_single, variant):
    model = perturb(make(dilation=2, period=1, mha=variant == "mha", post=variant == "post_norm",
                         n_loops=2 if variant == "loops2" else 1))
    _compare_with_reference(model, 2, 1)


def _compare_with_reference(model, dilation, period):
    ids = ids_for()
    fast, g_fast = loss_and_grads(model, lambda: model(ids), ids)
    slow, g_slow = loss_and_grads(
        model, lambda: reference_logits(model, ids, dilation, period), ids)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    assert set(g_fast) == set(g_slow) and any(".alpha." in n for n in g_fast)
    for name in g_slow:
        torch.testing.assert_close(g_fast[name], g_slow[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("dilation,period,post", [(1, 1, False), (2, 3, False), (3, 2, True)])
def test_at_init_equals_vanilla_exactly(megatron_single, dilation, period, post):
    """Same seed -> same weights; alpha = identity -> bit-identical logits (fp32)."""
    vanilla = make(dtype=None, mixer="vanilla", layers=6, post=post)
    dense = make(dtype=None, dilation=dilation, period=period, layers=6, post=post)
    shared = dict(vanilla.named_parameters())
    extra = {n for n, _ in dense.named_parameters()} - set(shared)
    assert extra and all(".post_layer.alpha." in n for n in extra)
    for name, p in dense.named_parameters():
        if name in shared:
            assert torch.equal(p, shared[name]), name
    ids = ids_for()
    with torch.no_grad():
        assert torch.equal(dense(ids), vanilla(ids))


def test_parameters_marked_and_counted(megatron_single):
    """d(d+3)/2 scalars for a 1x1 DenseFormer of depth d (paper Sec. 3), identity init."""
    model = make(layers=6)
    alphas = [(n, p) for n, p in model.named_parameters() if ".alpha." in n]
    assert sum(p.numel() for _, p in alphas) == sum(i + 1 for i in range(1, 7))
    for name, p in alphas:
        assert p.no_weight_decay is True and p.sequence_parallel is False, name
        assert p[-1] == 1 and torch.all(p[:-1] == 0), name
    stats = {}
    with torch.no_grad():
        model(ids_for(), stats=stats)
    assert set(stats) == {f"layer{u}/dwa_weights" for u in range(6)}


def test_validation_names_the_option():
    for option in ("dilation", "period"):
        run = tiny_run("denseformer", **{option: 0})
        with pytest.raises(ConfigError, match=f"mixer.{option}=0"):
            validate(run)


def expected_live(boundary, layers, k, p):
    """Entering block ``boundary + 1``: its input Y_boundary, and every X_j (j <= boundary)
    a DWA after block ``boundary + 1`` or later will average."""
    dwa = lambda i: i >= 1 and i % p == 0  # noqa: E731
    names = {f"y{boundary}" if dwa(boundary) else f"x{boundary}"}
    for j in range(boundary + 1):
        if any(dwa(i) and (i - j) % k == 0 for i in range(boundary + 1, layers + 1)):
            names.add(f"x{j}")
    return names


@pytest.mark.parametrize("layers", [4, 7])
@pytest.mark.parametrize("dilation,period", OPTIONS + [(4, 5)])
def test_plan_is_exact(layers, dilation, period):
    geo = DWAGeometry(layers, dilation, period)
    plan = DepthPlan(geo.entries(64), layers)
    for boundary in range(layers + 1):
        expected = expected_live(boundary, layers, dilation, period)
        assert plan.live_names(boundary) == expected, boundary
