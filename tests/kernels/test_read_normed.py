"""A sublayer's input RMSNorm inside the aggregation kernel (``ResidualOp.read_normed`` with
``mixer.impl=triton``), against aggregation then the separate :class:`RMSNorm` module, in
Triton's interpreter on CPU (fp32):

* the kernels: AttnRes with its output norm, the mHC read with ``norm_weight``; the normed
  input and the gradients of every input, the norm's weight included, within 2e-6 of each
  tensor's largest entry;
* a tiny model (one layer) with ``impl=triton``, fused against the same model reading
  through ``norm(read(...))``: the same loss and parameter gradients within fp32 rounding,
  and the fused path taken (the norm modules run only where nothing fuses them).
"""

import pytest
import torch

from depthmix.kernels.attnres import attnres_reference, attnres_triton
from depthmix.kernels.mhc import mhc_read_reference, mhc_read_triton
from depthmix.megatron_ext.layer import ResidualOp
from depthmix.megatron_ext.norm import RMSNorm
from depthmix.mixers.mhc import coefficient_width
from depthmix.testing import build_model, tiny_run

TOL = 2e-6
EPS, NORM_EPS = 1e-6, 1e-5


def assert_ratio(name, ours, ref, tol=TOL):
    """max |ours - ref| <= tol * max |ref|."""
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = (ours.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert err <= tol * scale, f"{name}: max err {err:.3e} > {tol:.0e} x {scale:.3e}"


def separate_norm(weight):
    """The layer's own norm module with ``weight``: what the fused kernels replace."""
    config = type("Config", (), {"params_dtype": weight.dtype, "sequence_parallel": False})
    norm = RMSNorm(config, weight.numel(), eps=NORM_EPS)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def compare(fused, aggregate, inputs, weight, grads, names):
    """``fused(*inputs, weight)`` against ``norm(aggregate(*inputs))`` evaluated in fp64 on
    the same values: outputs (a tuple whose first entry is the normed input) backpropagated
    from ``grads``, then the normed input and the gradients of the inputs and of the norm
    weight compared."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    outs = fused(*leaves, weight_leaf := weight.clone().requires_grad_())
    torch.autograd.backward(outs, grads)
    ours = [outs[0].detach()] + [t.grad for t in leaves] + [weight_leaf.grad]

    leaves = [t.double().requires_grad_() for t in inputs]
    norm = separate_norm(weight.double())
    x, *rest = aggregate(*leaves)
    outs = (norm(x), *rest)
    torch.autograd.backward(outs, [g.double() for g in grads])
    ref = [outs[0].detach()] + [t.grad for t in leaves] + [norm.weight.grad]
    for name, a, b in zip(["normed input", *names, "d norm weight"], ours, ref):
        assert_ratio(name, a, b)


# (sources, seq, batch, hidden): a partial last token tile, two hidden sizes
@pytest.mark.parametrize("num_sources,seq,batch,hidden", [(3, 7, 3, 80), (1, 5, 1, 64)],
                         ids=["S3-T21-d80", "S1-T5-d64"])
def test_attnres_kernel_norm_is_the_separate_norm(num_sources, seq, batch, hidden):
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(seq, batch, hidden, generator=g) * (1 + s) for s in range(num_sources)]
    query = 0.4 * torch.randn(hidden, generator=g)
    key_weight = 1 + 0.2 * torch.randn(hidden, generator=g)
    weight = 1 + 0.2 * torch.randn(hidden, generator=g)
    grad = torch.randn(seq, batch, hidden, generator=g)
    n = num_sources

    def fused(*t):
        return (attnres_triton(list(t[:n]), t[n], t[n + 1], EPS, t[n + 2], NORM_EPS),)

    def aggregate(*t):
        return (attnres_reference(list(t[:n]), t[n], t[n + 1], EPS),)

    names = [f"d source {i}" for i in range(n)] + ["d query", "d key_weight"]
    compare(fused, aggregate, [*sources, query, key_weight], weight, (grad,), names)


@pytest.mark.parametrize("variant,n,hidden,seq,batch",
                         [("mhc", 4, 80, 17, 1), ("identity", 2, 64, 7, 3)],
                         ids=["mhc-n4-h80-T17", "identity-n2-h64-T21"])
def test_mhc_read_norm_is_the_separate_norm(variant, n, hidden, seq, batch):
    g = torch.Generator().manual_seed(1)
    m = coefficient_width(variant, n)
    x = torch.randn(seq, batch, n, hidden, generator=g)
    phi = 0.05 * torch.randn(n * hidden, m, generator=g)
    alpha = torch.rand(2 if variant == "identity" else 3, generator=g) + 0.5
    bias = torch.randn(m, generator=g)
    weight = 1 + 0.2 * torch.randn(hidden, generator=g)
    # the normed input's gradient, and h_post's (what the write sends back)
    grads = (torch.randn(seq, batch, hidden, generator=g), torch.randn(seq, batch, n, generator=g))

    def fused(x, phi, alpha, bias, weight):
        x_in, _, h_post, _ = mhc_read_triton(x, phi, alpha, bias, variant, 2, EPS, weight,
                                             NORM_EPS)
        return x_in, h_post

    def aggregate(x, phi, alpha, bias):
        x_in, _, h_post, _ = mhc_read_reference(x, phi, alpha, bias, variant, 2, EPS)
        return x_in, h_post

    compare(fused, aggregate, [x, phi, alpha, bias], weight, grads,
            ["dx", "dphi", "dalpha", "dbias"])


# ---------------------------------------------------------------------------------------
# A tiny model: fused against norm(read(...)) in the same model
# ---------------------------------------------------------------------------------------


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def count_norm_calls(model):
    calls = []
    for name, module in model.named_modules():
        if name.endswith(("input_layernorm", "pre_mlp_layernorm")):
            module.register_forward_hook(lambda *args, name=name: calls.append(name))
    return calls


@pytest.mark.parametrize("mixer,residual,options", [
    ("attnres_full", "depthmix.mixers.attnres.model.AttnResResidual", {}),
    ("mhc", "depthmix.mixers.mhc.model.HyperConnection", {"streams": 2, "sinkhorn_iters": 2}),
], ids=["attnres_full", "mhc"])
def test_tiny_model_fused_equals_unfused(megatron_single, monkeypatch, mixer, residual, options):
    """Block AttnRes reads through the same ``read_normed`` as Full."""
    run = tiny_run(mixer, impl="triton", **options)
    run.model.num_layers, run.model.seq_length = 1, 8
    model = build_model(run)
    with torch.no_grad():  # norm weights away from 1, so that their use is checked
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    calls = count_norm_calls(model)

    fused, fused_grads = loss_and_grads(model, ids)
    assert calls == [], "the fused read ran the norm module"
    monkeypatch.setattr(residual + ".read_normed", ResidualOp.read_normed)
    plain, plain_grads = loss_and_grads(model, ids)
    assert len(calls) == 2

    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    assert set(fused_grads) == set(plain_grads)
    assert any("layernorm.weight" in n for n in fused_grads)
    for name, grad in plain_grads.items():
        assert_ratio(name, fused_grads[name], grad, 1e-5)
