"""Sequence-axis ShortSWA (mixer.short_swa_window=w, any mixer): slow reference of seed
004's block vs the vectorised path, the window invariants, the KV cache's window.
(Decoding and recomputation: test_conformance.py.)"""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from resop_reference import (
    assert_matches_reference,
    context,
    embed,
    lm_logits,
    mlp_sublayer,
    run_ids,
)

from depthmix.config.schema import ConfigError
from depthmix.megatron_ext.attention import causal_sdpa
from depthmix.megatron_ext.short_swa import sliding_window_sdpa
from depthmix.testing import build_model, tiny_run


def make(window, mixer="vanilla", gqa=True, seq=16, **options):
    run = tiny_run(mixer, short_swa_window=window, **options)
    run.model.seq_length = seq
    if not gqa:
        run.model.num_query_groups = run.model.num_attention_heads
    return run, build_model(run, dtype=torch.float64)


# ---------------------------------------------------------------------------------------
# Slow reference: the window attention with loops over query positions and heads, and
# the Residual Stream Duality paper's block  S = H + ShortSWA(Norm(H); w); A = S + Attn(Norm(S));
# H' = A + MLP(Norm(A)).
# ---------------------------------------------------------------------------------------


def loop_short_swa(swa, x, ctx):
    attn = swa.attention
    query, key, value = attn.get_query_key_value_tensors(swa.norm(x))
    query = apply_rotary_pos_emb(query, ctx.rotary_pos_emb, config=attn.config)
    key = apply_rotary_pos_emb(key, ctx.rotary_pos_emb, config=attn.config)
    s, b, heads, d = query.shape
    group = heads // key.shape[2]
    rows = []
    for t in range(s):
        per_head = []
        for hd in range(heads):
            g = hd // group
            lo = max(0, t - swa.window + 1)
            scores = torch.stack([(query[t, :, hd] * key[j, :, g]).sum(-1) / d**0.5
                                  for j in range(lo, t + 1)])  # [keys, b]
            weights = torch.softmax(scores, dim=0)
            per_head.append(sum(weights[j - lo][:, None] * value[j, :, g]
                                for j in range(lo, t + 1)))  # [b, d]
        rows.append(torch.cat(per_head, dim=-1))
    out, _ = attn.linear_proj(torch.stack(rows))
    return out


def reference_logits(model, ids):
    h = embed(model, ids)
    ctx = context(model, ids.shape[1])
    for u, layer in model.decoder.unrolled():
        ctx.layer = u
        s = h + loop_short_swa(layer.short_swa, h, ctx)
        a = s + layer.self_attention(layer.input_layernorm(s), {}, ctx)
        h = a + mlp_sublayer(layer, a)
    return lm_logits(model, h)


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("window,gqa", [(1, True), (3, True), (4, False), (8, True)])
def test_model_matches_seed_004_block(megatron_single, window, gqa):
    """Forward logits and every parameter gradient (ShortSWA's included), fp64."""
    run, model = make(window, gqa=gqa, seq=8)
    ids = run_ids(run)
    assert_matches_reference(model, ids, reference_logits)


def test_window_one_mixes_no_positions(megatron_single):
    """w = 1: each position attends only to itself, so ShortSWA is the per-token map
    x -> W_o v(norm(x)) and its output at t ignores every other position."""
    run, model = make(1)
    swa = model.decoder.layers[0].short_swa
    x = torch.randn(16, 2, run.model.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    ctx = context(model, 16)
    out = swa(x, ctx)
    _, _, value = swa.attention.get_query_key_value_tensors(swa.norm(x))
    group = run.model.num_attention_heads // run.model.num_query_groups
    per_token, _ = swa.attention.linear_proj(value.repeat_interleave(group, dim=2).flatten(2))
    torch.testing.assert_close(out, per_token, rtol=1e-12, atol=1e-14)
    x2 = x.clone()
    x2[5] += 1.0
    changed = (swa(x2, ctx) - out).abs().amax(dim=(1, 2))
    assert changed[5] > 0 and changed[torch.arange(16) != 5].max() == 0


def test_window_covering_the_sequence_is_causal_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(12, 2, 4, 8, dtype=torch.float64, generator=g)
    k = torch.randn(12, 2, 2, 8, dtype=torch.float64, generator=g)
    v = torch.randn(12, 2, 2, 8, dtype=torch.float64, generator=g)
    full = causal_sdpa(q, k, v)
    for window, block in ((12, None), (40, None), (12, 5)):
        torch.testing.assert_close(sliding_window_sdpa(q, k, v, window, block=block), full)
    # blocks do not change the result for a short window either, and decoding from a
    # cache holding only the last w - 1 keys equals the full computation
    ref = sliding_window_sdpa(q, k, v, 3, block=64)
    torch.testing.assert_close(sliding_window_sdpa(q, k, v, 3, block=2), ref)
    torch.testing.assert_close(sliding_window_sdpa(q[-1:], k[-3:], v[-3:], 3), ref[-1:])


def test_cache_keeps_only_the_window(megatron_single):
    from depthmix.inference import KVCache

    run, model = make(4)
    model.eval()
    ids = run_ids(run)
    cache = KVCache()
    with torch.no_grad():
        model(ids[:, :6], inference=cache)
        cache.advance(6)
        model(ids[:, 6:7], inference=cache)
    for layer in range(run.model.num_layers):
        assert cache.keys[("swa", layer)].shape[0] == 3  # w - 1
        assert cache.values[("swa", layer)].shape[0] == 3
        assert cache.keys[layer].shape[0] == 7  # sequence attention keeps everything


def test_wired_for_every_mixer_without_changing_other_weights(megatron_single):
    """One switch in the shared layer spec; its weights come from their own seed, so the
    rest of the model equals the model without ShortSWA."""
    vanilla = build_model(tiny_run("vanilla"), dtype=torch.float64)
    ref = dict(vanilla.named_parameters())
    for mixer in ("vanilla", "mhc", "ddl"):
        _, model = make(2, mixer)
        names = [n for n, _ in model.named_parameters()]
        swa = [n for n in names if ".short_swa." in n]
        per_layer = {"norm.weight", "attention.linear_qkv.weight", "attention.linear_proj.weight",
                     "attention.q_layernorm.weight", "attention.k_layernorm.weight"}
        assert {n.split(".short_swa.")[1] for n in swa} == per_layer
        assert len(swa) == len(per_layer) * run_layers()
        params = dict(model.named_parameters())
        for name, p in ref.items():
            assert torch.equal(params[name], p), (mixer, name)


def run_layers():
    return tiny_run("vanilla").model.num_layers


def test_negative_window_is_refused():
    from depthmix.config.validate import validate

    with pytest.raises(ConfigError, match="mixer.short_swa_window=-2"):
        validate(tiny_run("vanilla", short_swa_window=-2))
