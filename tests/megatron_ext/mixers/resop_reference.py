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
