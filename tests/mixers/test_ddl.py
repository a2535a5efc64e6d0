"""Deep Delta Learning (mixer=ddl): slow paper reference vs the vectorised path, the
Delta operator's properties at init, validation. (Decoding and recomputation:
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
from depthmix.kernels.ddl.reference import K_EPS
from depthmix.kernels.ddl.reference import ddl_write_reference as ddl_write
from depthmix.testing import build_model, tiny_run


def make(value_channels=3, gqa=True, dtype=torch.float64, **options):
    run = tiny_run("ddl", value_channels=value_channels, **options)
    if not gqa:
        run.model.num_query_groups = run.model.num_attention_heads
    return run, build_model(run, dtype=dtype)


# ---------------------------------------------------------------------------------------
# Slow reference from the paper's update X <- X + beta k (v^T - k^T X): loops over
# sublayers, token positions and value channels (columns of X).
# ---------------------------------------------------------------------------------------


def delta_block(cols, op, sublayer, eps, v_scale):
    """``cols``: the d_v columns of X, each [s, b, h]. Returns the new columns."""
    dv = len(cols)
    x_in = sum(op.read_vector[c] * cols[c] for c in range(dv))  # X r
    y = sublayer(x_in)
    s, b, _ = x_in.shape
    new = [[[None] * b for _ in range(s)] for _ in range(dv)]
    for t in range(s):
        for i in range(b):
            k = y[t, i] / torch.sqrt(y[t, i].dot(y[t, i]) + K_EPS**2)  # ||k|| = 1
            xi = x_in[t, i]
            xn = xi / torch.sqrt(xi.dot(xi) / xi.numel() + eps)
            beta = 2 * torch.sigmoid(op.beta_weight.dot(xn) + op.beta_bias[0])
            for c in range(dv):
                v = v_scale * torch.sigmoid(op.v_weight[c].dot(xi) + op.v_bias[c])
                col = cols[c][t, i]
                new[c][t][i] = col + beta * k * (v - k.dot(col))
    return [torch.stack([torch.stack(new[c][t]) for t in range(s)]) for c in range(dv)]


def reference_logits(model, ids):
    eps = model.config.layernorm_epsilon
    mc = model.config.mixer
    emb = embed(model, ids)
    cols = [emb.clone() for _ in range(mc.value_channels)]  # embedding replicated
    ctx = context(model, ids.shape[1])
    for u, layer in model.decoder.unrolled():
        ctx.layer = u
        cols = delta_block(cols, layer.attn_residual,
                           lambda x: attention_sublayer(layer, x, ctx), eps, mc.v_scale)
        cols = delta_block(cols, layer.mlp_residual, lambda x: mlp_sublayer(layer, x), eps,
                           mc.v_scale)
    r = model.head.read_vector
    return lm_logits(model, sum(r[c] * cols[c] for c in range(mc.value_channels)))


def randomise_mixing(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(key in name for key in ("read_vector", "beta_", "v_weight", "v_bias")):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_channels,gqa,options", [
    (3, True, {}),
    (1, False, {"beta_init": 0.2, "v_scale": 1.5}),
    (2, True, {"short_swa_window": 2}),
])
def test_vectorised_matches_paper_reference(megatron_single, value_channels, gqa, options):
    run = tiny_run("ddl", value_channels=value_channels, **options)
    run.model.seq_length = 8  # the reference loops over tokens
    if not gqa:
        run.model.num_query_groups = run.model.num_attention_heads
    model = build_model(run, dtype=torch.float64)
    randomise_mixing(model)
    ids = run_ids(run)
    assert_matches_reference(model, ids, reference_logits)


def test_first_sublayer_reads_the_embedding(megatron_single):
    """At init the replicated embedding read with r = 1/d_v is the embedding: the first
    sublayer sees exactly what the vanilla network's first sublayer sees."""
    for dv in (1, 2, 3, 4):
        run, model = make(dv)
        emb = embed(model, run_ids(run))
        state = model.stem(emb)
        x_in, _ = model.decoder.layers[0].attn_residual.read(state, None)
        # 1/d_v is exact in the fp32 parameters for powers of two; 1/3 is rounded once.
        rtol = 1e-15 if dv in (1, 2, 4) else 1e-7
        torch.testing.assert_close(x_in, emb, rtol=rtol, atol=0)
        torch.testing.assert_close(model.head(state, None), emb, rtol=rtol, atol=0)


def test_delta_operator_spectrum_and_gate():
    """The paper's Theorem: the update is X' = (I - beta k k^T) X + beta k v^T with
    ||k|| = 1, so the complement of k is untouched and the k-component becomes
    (1 - beta) k^T X + beta v; beta = 1 (the init gate) overwrites it with v."""
    g = torch.Generator().manual_seed(0)
    s, b, h, dv = 5, 2, 16, 3
    x = torch.randn(s, b, h, dv, dtype=torch.float64, generator=g)
    y = torch.randn(s, b, h, dtype=torch.float64, generator=g)
    x_in = torch.randn(s, b, h, dtype=torch.float64, generator=g)
    v_weight = torch.randn(dv, h, dtype=torch.float64, generator=g) * 0.1
    v_bias = torch.randn(dv, dtype=torch.float64, generator=g)
    k = y / torch.sqrt(y.pow(2).sum(-1, keepdim=True) + K_EPS**2)  # unit up to K_EPS
    v = 4.0 * torch.sigmoid(x_in @ v_weight.t() + v_bias)
    proj = torch.einsum("sbh,sbhc->sbc", k, x)
    for beta_init, beta_weight in ((1.0, torch.zeros(h)), (0.3, torch.zeros(h)),
                                   (1.0, torch.randn(h, generator=g))):
        beta_bias = torch.tensor([math.log(beta_init / (2 - beta_init))])
        new, beta = ddl_write(x, y, x_in, beta_weight.double(), beta_bias.double(), v_weight,
                              v_bias, 4.0, 1e-6)
        assert ((beta > 0) & (beta < 2)).all()
        if not beta_weight.any():  # zero gate weights: beta is beta_init for every token
            torch.testing.assert_close(beta, torch.full_like(beta, beta_init))
        a = torch.eye(h, dtype=torch.float64) - beta[..., None] * k[..., :, None] * k[..., None, :]
        expected = a @ x + beta[..., None] * k[..., :, None] * v[..., None, :]
        torch.testing.assert_close(new, expected, rtol=1e-12, atol=1e-12)
        new_proj = torch.einsum("sbh,sbhc->sbc", k, new)
        torch.testing.assert_close(new_proj, (1 - beta) * proj + beta * v, rtol=1e-9, atol=1e-9)
        orth = x - k[..., None] * proj[..., None, :]
        new_orth = new - k[..., None] * new_proj[..., None, :]
        torch.testing.assert_close(new_orth, orth, rtol=1e-9, atol=1e-9)
        # spectrum {1, ..., 1, 1 - beta}: identity / projection / reflection
        eig = torch.linalg.eigvalsh(a[0, 0])
        expected_eig = torch.ones(h, dtype=torch.float64)
        expected_eig[0] = 1 - beta[0, 0, 0]
        torch.testing.assert_close(eig.sort().values, expected_eig.sort().values,
                                   rtol=0, atol=1e-9)


def test_gate_starts_at_beta_init(megatron_single):
    run, model = make(beta_init=0.5)
    for layer in model.decoder.layers:
        for op in (layer.attn_residual, layer.mlp_residual):
            assert math.isclose(2 * torch.sigmoid(op.beta_bias).item(), 0.5, rel_tol=1e-6)
            torch.testing.assert_close(op.read_vector, torch.full((3,), 1 / 3,
                                                                  dtype=torch.float64))
            assert not op.v_bias.any()
    stats = {}
    with torch.no_grad():
        model(run_ids(run), stats=stats)
    betas = torch.stack([v for k, v in stats.items() if k.endswith("/beta")])
    assert betas.numel() == 2 * run.model.num_layers
    assert (betas - 0.5).abs().max() < 0.05  # gate weights are small at init


def test_plan_and_parameters(megatron_single):
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.mixers.ddl import ddl_plan
    from depthmix.mixers.ddl.model import DeltaResidual

    run, model = make(4)
    config = to_transformer_config(run)
    (entry,) = ddl_plan(config, tp=2)
    assert entry.shape == (run.model.hidden_size, 4) and entry.seq_sharded
    mixing = [p for n, p in model.named_parameters()
              if "attn_residual" in n or "mlp_residual" in n or n.startswith("head.")]
    assert len(mixing) == 5 * 2 * run.model.num_layers + 1
    assert all(p.no_weight_decay and p.sequence_parallel is False for p in mixing)
    config.sequence_parallel = True
    assert all(p.sequence_parallel for p in DeltaResidual(config, 1, "attn").parameters())


def test_same_seed_shares_the_sublayer_weights_with_vanilla(megatron_single):
    vanilla = build_model(tiny_run("vanilla"), dtype=torch.float64)
    _, model = make()
    mine = dict(model.named_parameters())
    for name, p in vanilla.named_parameters():
        assert torch.equal(mine[name], p), name


@pytest.mark.parametrize("option,value,needle", [
    ("value_channels", 0, "mixer.value_channels=0"),
    ("beta_init", 2.0, "mixer.beta_init=2.0"),
    ("beta_init", 0.0, "mixer.beta_init=0.0"),
    ("v_scale", 0.0, "mixer.v_scale=0.0"),
])
def test_validation_names_the_option(option, value, needle):
    from depthmix.config.validate import validate

    with pytest.raises(ConfigError, match=needle):
        validate(tiny_run("ddl", **{option: value}))


def test_post_norm_is_refused():
    from depthmix.config.validate import validate

    run = tiny_run("ddl")
    run.model.norm_position = "post"
    with pytest.raises(ConfigError, match="model.norm_position"):
        validate(run)
