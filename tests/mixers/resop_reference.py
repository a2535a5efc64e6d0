"""Shared helpers for the mixer tests (slow references reuse the model's own sublayers)."""

import torch

from depthmix.megatron_ext.context import ForwardContext


def embed(model, ids):
    s = ids.shape[1]
    pos = torch.arange(s).unsqueeze(0).expand_as(ids)
    return model.embedding(input_ids=ids, position_ids=pos)  # [s, b, h]


def context(model, s):
    return ForwardContext(rotary_pos_emb=model.rotary_pos_emb(s))


def attention_sublayer(layer, x, ctx):
    """The attention sublayer exactly as the paper block writes it, ShortSWA included:
    ``s = swa(x)``; ``y = s + attn(norm(x + s))``."""
    s = layer.short_swa(x, ctx)
    if s is None:
        return layer.self_attention(layer.input_layernorm(x), {}, ctx)
    return s + layer.self_attention(layer.input_layernorm(x + s), {}, ctx)


def mlp_sublayer(layer, x):
    y, _ = layer.mlp(layer.pre_mlp_layernorm(x))
    return y


def lm_logits(model, hidden):
    logits, _ = model.output_layer(model.final_layernorm(hidden))
    return logits.transpose(0, 1)  # [b, s, v]


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b, rtol=1e-10, atol=1e-12):
    """Every parameter's gradient: ``||a - b|| <= rtol ||b|| + atol`` (per parameter; a
    norm-wise test, since single entries of a large gradient can cancel to ~0)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for name in a:
        err = (a[name] - b[name]).norm().item()
        scale = b[name].norm().item()
        assert err <= rtol * scale + atol, f"{name}: |diff| {err:.3e}, |grad| {scale:.3e}"


def ids_for(batch=2, seq=16, vocab=128, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, fn, ids, seed=7):
    """Logits of ``fn()`` and the parameter gradients of a fixed random projection of them."""
    weights = torch.randn(ids.shape[0], ids.shape[1], model.vocab_size,
                          generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    logits = fn()
    grads = grads_of(model, (logits * weights.to(logits.dtype)).sum())
    return logits.detach(), grads


def assert_recompute_matches(plain, recomputed, ids, rtol=1e-12):
    """Activation recomputation changes nothing: the same logits bit for bit, and each
    parameter's gradient within ``rtol`` of its norm (``rtol=0``: identical). Returns the
    gradients of ``plain``."""
    a, ga = loss_and_grads(plain, lambda: plain(ids), ids)
    b, gb = loss_and_grads(recomputed, lambda: recomputed(ids), ids)
    assert torch.equal(a, b)
    assert ga.keys() == gb.keys()
    for name in ga:
        assert (gb[name] - ga[name]).norm() <= rtol * ga[name].norm(), name
    return ga


def run_ids(run, batch=2, seed=0):
    """Token ids shaped for ``run``'s model."""
    return ids_for(batch, run.model.seq_length, run.model.vocab_size, seed)


def assert_matches_reference(model, ids, reference_logits):
    """Logits and every parameter gradient of ``model(ids)`` equal the slow reference's
    (fp64, 1e-10), through a fixed random projection of the logits."""
    w = torch.randn(ids.shape[0], ids.shape[1], model.vocab_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    fast = model(ids)
    torch.testing.assert_close(fast, reference_logits(model, ids), rtol=1e-10, atol=1e-12)
    assert_same_grads(grads_of(model, (fast * w).sum()),
                      grads_of(model, (reference_logits(model, ids) * w).sum()))
