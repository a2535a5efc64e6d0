"""mHC / Hyper-Connections (mixer=mhc): slow paper reference vs the vectorised path, the
initialisation invariants, Sinkhorn, statistics. (Decoding and recomputation:
test_conformance.py.)"""

import math

import pytest
import torch
from resop_reference import (
    assert_matches_reference,
    run_ids,
    attention_sublayer,
    context,
    embed,
    lm_logits,
    mlp_sublayer,
)

from depthmix.config.schema import ConfigError
from depthmix.kernels.mhc import mhc_coefficients, sinkhorn_reference
from depthmix.testing import build_model, tiny_run

VARIANTS = ["mhc", "hc", "identity"]


def make(variant="mhc", streams=3, gqa=True, dtype=torch.float64, **options):
    run = tiny_run("mhc", variant=variant, streams=streams, **options)
    if not gqa:
        run.model.num_query_groups = run.model.num_attention_heads
    return run, build_model(run, dtype=dtype)


# ---------------------------------------------------------------------------------------
# Slow reference, straight from the papers' equations: loops over sublayers, streams and
# Sinkhorn rows/columns; per-token quantities are [s, b] tensors (tokens are independent
# in the stream mixing, so they need no loop).
# ---------------------------------------------------------------------------------------


def plain_sinkhorn(logits, iters):
    """``logits``: n x n nested lists of [s, b] tensors."""
    n = len(logits)
    m = []
    for i in range(n):
        row_max = logits[i][0]
        for j in range(1, n):
            row_max = torch.maximum(row_max, logits[i][j])
        m.append([torch.exp(logits[i][j] - row_max) for j in range(n)])
    for _ in range(iters):
        for i in range(n):
            total = sum(m[i][j] for j in range(n))
            m[i] = [m[i][j] / total for j in range(n)]
        for j in range(n):
            total = sum(m[i][j] for i in range(n))
            for i in range(n):
                m[i][j] = m[i][j] / total
    return m


def loop_coefficients(streams, op, eps):
    """(H_pre[i], H_post[i], H_res[i][j] or None) as [s, b] tensors, from the equations:
    x' = RMSNorm(vec X); d = x' phi; mHC: sigmoid / 2 sigmoid / Sinkhorn, HC: b + a tanh."""
    n, h = len(streams), streams[0].shape[-1]
    mean_sq = sum((x * x).sum(-1) for x in streams) / (n * h)
    rinv = 1.0 / torch.sqrt(mean_sq + eps)
    phi, a, b = op.phi, op.alpha, op.bias

    def d(col):  # column `col` of x' phi
        return sum((streams[i] * rinv[..., None]) @ phi[i * h:(i + 1) * h, col] for i in range(n))

    if op.variant == "mhc":
        pre = [torch.sigmoid(a[0] * d(i) + b[i]) for i in range(n)]
        post = [2 * torch.sigmoid(a[1] * d(n + i) + b[n + i]) for i in range(n)]
        logits = [[a[2] * d(2 * n + i * n + j) + b[2 * n + i * n + j] for j in range(n)]
                  for i in range(n)]
        return pre, post, plain_sinkhorn(logits, op.sinkhorn_iters)
    pre = [b[i] + a[0] * torch.tanh(d(i)) for i in range(n)]
    post = [b[n + i] + a[1] * torch.tanh(d(n + i)) for i in range(n)]
    if op.variant == "identity":
        return pre, post, None
    res = [[b[2 * n + i * n + j] + a[2] * torch.tanh(d(2 * n + i * n + j)) for j in range(n)]
           for i in range(n)]
    return pre, post, res


def hyper_connection(streams, op, sublayer, eps):
    """X <- H_res X + H_post^T F(H_pre X), one stream at a time."""
    n = len(streams)
    pre, post, res = loop_coefficients(streams, op, eps)
    x_in = sum(pre[i][..., None] * streams[i] for i in range(n))
    y = sublayer(x_in)
    new = []
    for i in range(n):
        if res is None:
            mixed = streams[i]
        else:
            mixed = sum(res[i][j][..., None] * streams[j] for j in range(n))
        new.append(mixed + post[i][..., None] * y)
    return new


def reference_logits(model, ids):
    eps = model.config.layernorm_epsilon
    n = model.config.mixer.streams
    emb = embed(model, ids)
    streams = [emb.clone() for _ in range(n)]  # the embedding copied into n streams
    ctx = context(model, ids.shape[1])
    for u, layer in model.decoder.unrolled():
        ctx.layer = u
        streams = hyper_connection(streams, layer.attn_residual,
                                   lambda x: attention_sublayer(layer, x, ctx), eps)
        streams = hyper_connection(streams, layer.mlp_residual,
                                   lambda x: mlp_sublayer(layer, x), eps)
    return lm_logits(model, sum(streams) / n)  # the head reads the mean of the streams


def randomise_mixing(model, seed=0):
    """Move the coefficient network away from its init so every term matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".phi", ".alpha", ".bias")):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("streams,gqa,swa", [(3, True, 0), (1, False, 0), (2, True, 3)])
def test_vectorised_matches_paper_reference(megatron_single, variant, streams, gqa, swa):
    """Forward logits and every parameter gradient, fp64."""
    run, model = make(variant, streams, gqa, short_swa_window=swa, sinkhorn_iters=7)
    randomise_mixing(model)
    ids = run_ids(run)
    assert_matches_reference(model, ids, reference_logits)


def test_sinkhorn_is_doubly_stochastic():
    """Rows and columns sum to 1 within 1e-3 after the default 20 iterations for logits at
    the paper's init (6I - 3 plus the O(alpha) dynamic part) and for N(0, 1) logits.
    Columns are exact (the last step normalises them). Far from the init (near-diagonal
    logits plus spread) 20 iterations leave rows off by up to ~5e-2 (docs/methods/mhc.md):
    the finite-iteration gap mHC-lite (arXiv:2601.05732) points out; more iterations close it.
    """
    g = torch.Generator().manual_seed(0)
    for n in (2, 4, 8):
        ones = torch.ones(512, n)
        init = 6.0 * torch.eye(n) - 3.0 + 0.01 * torch.randn(512, n, n, generator=g)
        spread = torch.randn(512, n, n, generator=g) if n > 2 else init
        for logits in (init, spread):
            for dtype in (torch.float32, torch.bfloat16):
                m = sinkhorn_reference(logits.to(dtype), 20)
                assert m.dtype == torch.float32  # statistics in fp32 even for bf16 logits
                assert (m >= 0).all()
                torch.testing.assert_close(m.sum(-1), ones, rtol=0, atol=1e-3)
                torch.testing.assert_close(m.sum(-2), ones, rtol=0, atol=1e-6)
        hard = 6.0 * torch.eye(n) - 3.0 + 0.3 * torch.randn(512, n, n, generator=g)
        gaps = [(sinkhorn_reference(hard.double(), it).sum(-1) - 1).abs().max().item()
                for it in (20, 100, 500)]
        assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-3, gaps


def test_sinkhorn_row_max_shift_keeps_large_logits_finite():
    logits = torch.tensor([[1000.0, 990.0], [-5.0, 995.0]])
    m = sinkhorn_reference(logits, 20)
    assert torch.isfinite(m).all()
    torch.testing.assert_close(m, sinkhorn_reference(logits - 900.0, 20))


def test_sinkhorn_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(0)
    for iters in (1, 5, 20):
        logits = torch.randn(3, 4, 4, dtype=torch.float64, generator=g, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x: sinkhorn_reference(x, iters), (logits,), eps=1e-6,
                                        atol=1e-8, rtol=1e-6)


def test_sinkhorn_matches_plain_loop():
    g = torch.Generator().manual_seed(0)
    n = 4
    logits = torch.randn(5, 3, n, n, dtype=torch.float64, generator=g) * 2
    nested = [[logits[..., i, j] for j in range(n)] for i in range(n)]
    ref = plain_sinkhorn(nested, 20)
    fast = sinkhorn_reference(logits, 20)
    for i in range(n):
        for j in range(n):
            torch.testing.assert_close(fast[..., i, j], ref[i][j], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("variant", ["hc", "identity"])
@pytest.mark.parametrize("streams", [2, 4])
def test_hc_zero_dynamic_one_hot_pre_equals_vanilla_exactly(megatron_single, variant, streams):
    """Zhu et al.'s residual-equivalent init (pre one-hot on the home stream, post all ones,
    H_res = I) with zero dynamic weights reproduces the plain residual network bit for bit:
    all streams carry the residual stream and the head reads their mean."""
    _, vanilla = make_vanilla()
    run, model = make(variant, streams)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".phi"):
                p.zero_()
    ids = run_ids(run)
    with torch.no_grad():
        assert torch.equal(model(ids), vanilla(ids))


def make_vanilla():
    run = tiny_run("vanilla")
    return run, build_model(run, dtype=torch.float64)


def test_mhc_paper_init_closely_matches_vanilla(megatron_single):
    """Not exact, for two reasons: sigmoid(+-3) makes H_pre sum to 0.95 + (n-1) 0.047 (the
    sublayer input is rescaled, which the pre-norm undoes only up to its epsilon), and the
    dynamic part alpha (x' phi) with alpha = 0.01 perturbs every coefficient by O(alpha)."""
    _, vanilla = make_vanilla()
    run, model = make("mhc", streams=4)
    ids = run_ids(run)
    with torch.no_grad():
        ref = vanilla(ids)
        scale = ref.abs().max().item()
        err = (model(ids) - ref).abs().max().item()
        assert 0 < err <= 1e-2 * scale, (err, scale)  # O(alpha)
        for name, p in model.named_parameters():
            if name.endswith(".phi"):
                p.zero_()
        err = (model(ids) - ref).abs().max().item()
        assert err <= 1e-3 * scale, (err, scale)  # only the norm's epsilon is left
    # The coefficients at init are those of a residual connection: H_res ~ I, H_pre ~
    # one-hot on the home stream, H_post ~ 1 (Megatron-LM's zero biases would give H_res =
    # 1/n everywhere and H_pre = 1/2: the same forward at step 0 with equal streams, but
    # not an identity shortcut).
    state = model.stem(embed(model, ids))
    for u, layer in model.decoder.unrolled():
        for op in (layer.attn_residual, layer.mlp_residual):
            h_pre, h_post, h_res = op.coefficients(state["streams"])
            eye = torch.eye(4, dtype=h_res.dtype)
            assert (h_res - eye).abs().max() < 0.01
            home = torch.zeros(4, dtype=h_pre.dtype)
            home[op.home] = 1.0
            assert (h_pre - home).abs().max() < 0.05
            assert (h_post - 1.0).abs().max() < 0.02
    homes = [op.home for layer in model.decoder.layers
             for op in (layer.attn_residual, layer.mlp_residual)]
    assert homes == [k % 4 for k in range(2 * run.model.num_layers)]


def test_statistics_are_recorded(megatron_single):
    run, model = make("mhc", streams=3)
    stats = {}
    with torch.no_grad():
        model(run_ids(run), stats=stats)
    for layer in range(run.model.num_layers):
        for sub in ("attn", "mlp"):
            h_res = stats[f"layer{layer}/{sub}/H_res"]
            assert h_res.shape == (3, 3)
            torch.testing.assert_close(h_res.sum(0), torch.ones(3, dtype=h_res.dtype),
                                       rtol=0, atol=1e-3)
            assert stats[f"layer{layer}/{sub}/H_pre"].shape == (3,)
            assert stats[f"layer{layer}/{sub}/H_post"].shape == (3,)
    assert len(stats) == 3 * 2 * run.model.num_layers


def test_plan_parameters_and_transport(megatron_single):
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.planning.pipeline import PipelineLayout, geometry_of
    from depthmix.mixers.mhc import mhc_plan
    from depthmix.mixers.mhc.model import HyperConnection

    run, model = make("mhc", streams=4)
    config = to_transformer_config(run)
    (entry,) = mhc_plan(config, tp=2)
    assert entry.shape == (4, run.model.hidden_size) and entry.seq_sharded
    config.sequence_parallel = True
    geo = geometry_of(mhc_plan, config, PipelineLayout(config.num_layers, 2), tp=2)
    # PP=2 with SP: one transition carrying the 4 streams of the local sequence shard.
    assert geo.payload_bytes(1, micro_batch_size=2, element_size=2) == 8 * 2 * 4 * 64 * 2
    assert geo.rows(1) == 8 * 4
    mixing = [p for n, p in model.named_parameters() if n.endswith((".phi", ".alpha", ".bias"))]
    assert len(mixing) == 3 * 2 * run.model.num_layers
    assert all(p.no_weight_decay and p.sequence_parallel is False for p in mixing)
    op = HyperConnection(config, layer_number=1, sublayer="mlp")
    assert all(p.sequence_parallel and p.no_weight_decay for p in op.parameters())
    n, h = 4, run.model.hidden_size
    assert op.phi.shape == (n * h, 2 * n + n * n) and op.home == 1


def test_same_seed_shares_the_sublayer_weights_with_vanilla(megatron_single):
    """The mixing parameters draw from their own seed: everything else equals vanilla."""
    _, vanilla = make_vanilla()
    _, model = make("mhc")
    ref = dict(vanilla.named_parameters())
    shared = [n for n, _ in model.named_parameters() if n in ref]
    assert len(shared) == len(ref)
    for name in shared:
        assert torch.equal(dict(model.named_parameters())[name], ref[name]), name


@pytest.mark.parametrize("option,value,needle", [
    ("streams", 0, "mixer.streams=0"),
    ("sinkhorn_iters", 0, "mixer.sinkhorn_iters=0"),
    ("variant", "mhcc", "mixer.variant='mhcc'"),
    ("short_swa_window", -1, "mixer.short_swa_window=-1"),
])
def test_validation_names_the_option(option, value, needle):
    from depthmix.config.validate import validate

    run = tiny_run("mhc", **{option: value})
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        validate(run)


def test_post_norm_is_refused():
    from depthmix.config.validate import validate

    run = tiny_run("mhc")
    run.model.norm_position = "post"
    with pytest.raises(ConfigError, match="model.norm_position"):
        validate(run)


def test_bf16_state_keeps_fp32_coefficients():
    g = torch.Generator().manual_seed(0)
    n, h = 4, 16
    x = torch.randn(3, 2, n, h, generator=g).bfloat16()
    phi = (torch.randn(n * h, 2 * n + n * n, generator=g) * 0.02).bfloat16()
    alpha = torch.full((3,), 0.01).bfloat16()
    bias = torch.cat([torch.zeros(2 * n), (6 * torch.eye(n) - 3).flatten()]).bfloat16()
    h_pre, h_post, h_res = mhc_coefficients(x, phi, alpha, bias, "mhc", 20)
    assert h_pre.dtype == h_post.dtype == h_res.dtype == torch.float32
    torch.testing.assert_close(h_res.sum(-1), torch.ones(3, 2, n), rtol=0, atol=1e-3)
    assert math.isclose(h_post.mean().item(), 1.0, abs_tol=0.02)


def test_hydra_composes_the_mixers():
    from depthmix.config.load import compose_run
    from depthmix.config.validate import validate

    run = compose_run("mixer=mhc", "mixer.variant=hc", "mixer.streams=2",
                      "mixer.short_swa_window=8")
    assert (run.mixer.name, run.mixer.variant, run.mixer.streams) == ("mhc", "hc", 2)
    assert run.mixer.sinkhorn_iters == 20 and run.mixer.short_swa_window == 8
    validate(run)
    run = compose_run("mixer=ddl", "mixer.value_channels=2")
    assert (run.mixer.name, run.mixer.value_channels, run.mixer.beta_init) == ("ddl", 2, 1.0)
    with pytest.raises(ConfigError, match="mixer.variant='x'"):
        validate(compose_run("mixer=mhc", "mixer.variant=x"))
