"""MoDA (mixture-of-depths attention): the vectorised mixer against a slow reference written
from the paper (loops over layers, positions, heads and depth entries), the paper's
invariants, the RoPE convention, statistics, the plan and the pipeline bytes it implies,
and config validation. (Decoding and recomputation: test_conformance.py.)"""

import math

import pytest
import torch
from omegaconf import OmegaConf

from depthmix.config.schema import ConfigError
from depthmix.config.validate import validate
from depthmix.inference import KVCache
from depthmix.planning.pipeline import PipelineLayout, geometry_of
from depthmix.mixers.moda import model as moda_mod
from depthmix.mixers.moda import MoDAGeometry, moda_plan
from depthmix.testing import build_model, tiny_run
from resop_reference import ids_for, loss_and_grads

F64 = torch.float64


# ---------------------------------------------------------------------------------------
# Slow reference, straight from the MoDA paper (Sec. 2.3 "Mixture-of-Depths Attention", Alg. 1)
# ---------------------------------------------------------------------------------------


def rms(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rope(x, freqs):
    """Rotate-half RoPE of ``x [s, b, n, d]`` with Megatron's frequencies ``[s, 1, 1, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = torch.cos(freqs).to(x.dtype), torch.sin(freqs).to(x.dtype)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def project_kv(proj, x, freqs, ng, hn, eps):
    """A depth KV projection: rows of the weight are [group, (k, v), head_dim]."""
    out = (x @ proj.linear_kv.weight.T).view(*x.shape[:2], ng, 2, hn)
    k, v = out[..., 0, :], out[..., 1, :]
    if proj.k_layernorm is not None:
        k = rms(k, proj.k_layernorm.weight, eps)
    return rope(k, freqs), v


def reference_logits(model, ids, window=None, stats=None):
    """Logits of the MoDA model in ``model``'s weights, one token and one head at a time.

    Depth entries are kept in a list in the order they are written (attention k/v of layer
    ``l``, then its MLP's projected k/v); layer ``l``'s attention reads the last ``window``
    entries written before it. Each query sees causal keys ``j <= t`` of its layer and the
    depth entries of its own position ``t``, under one softmax.
    """
    cfg = model.config
    post = cfg.norm_position == "post"
    eps, hn = cfg.layernorm_epsilon, cfg.kv_channels
    nh, ng = cfg.num_attention_heads, cfg.num_query_groups
    g = nh // ng
    scale = 1.0 / math.sqrt(hn)
    b, s = ids.shape
    freqs = model.rotary_pos_emb(s)
    h = model.embedding.word_embeddings.weight[ids].transpose(0, 1)  # [s, b, hidden]
    written = []  # depth entries (k [s, b, ng, hn], v) or None where never computed

    for u, layer in model.decoder.unrolled():
        # ---- attention sublayer: read depth KV, attend, write own depth KV
        attn = layer.self_attention
        x = h if post else rms(h, layer.input_layernorm.weight, eps)
        qkv = (x @ attn.linear_qkv.weight.T).view(s, b, ng, (g + 2) * hn)
        q = qkv[..., : g * hn].reshape(s, b, nh, hn)
        k, v = qkv[..., g * hn : (g + 1) * hn], qkv[..., (g + 1) * hn :]
        if attn.q_layernorm is not None:
            q, k = rms(q, attn.q_layernorm.weight, eps), rms(k, attn.k_layernorm.weight, eps)
        q, k = rope(q, freqs), rope(k, freqs)
        depth = written[-window:] if window else list(written)
        assert all(e is not None for e in depth), "a depth entry read before being computed"
        if cfg.mixer.attn_kv_proj:
            proj = attn.depth_mixer.proj
            written.append(project_kv(proj, x, freqs, ng, hn, eps) if proj is not None else None)
        else:
            written.append((k, v))

        out = torch.zeros(s, b, nh, hn, dtype=h.dtype)
        depth_w = torch.zeros(len(depth), dtype=h.dtype)
        for n in range(b):
            for head in range(nh):
                grp = head // g
                for t in range(s):
                    qt = q[t, n, head]
                    logits = [k[: t + 1, n, grp] @ qt * scale]  # causal sequence keys
                    for dk, _ in depth:  # own position's depth keys
                        logits.append((dk[t, n, grp] @ qt * scale).view(1))
                    w = torch.softmax(torch.cat(logits), dim=0)
                    o = w[: t + 1] @ v[: t + 1, n, grp]
                    for i, (_, dv) in enumerate(depth):
                        o = o + w[t + 1 + i] * dv[t, n, grp]
                        depth_w[i] += w[t + 1 + i].detach()
                    out[t, n, head] = o
        if stats is not None:
            stats.append(depth_w / (b * nh * s))
        y = out.reshape(s, b, nh * hn) @ attn.linear_proj.weight.T
        h = rms(h + y, layer.attn_residual.post_norm.weight, eps) if post else h + y

        # ---- MLP sublayer (SwiGLU) and its depth KV projection
        x = h if post else rms(h, layer.pre_mlp_layernorm.weight, eps)
        if cfg.mixer.ffn_kv_proj:
            proj = layer.mlp_depth_kv.proj
            written.append(project_kv(proj, x, freqs, ng, hn, eps) if proj is not None else None)
        gate, up = (x @ layer.mlp.linear_fc1.weight.T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ layer.mlp.linear_fc2.weight.T
        h = rms(h + y, layer.mlp_residual.post_norm.weight, eps) if post else h + y

    h = rms(h, model.final_layernorm.weight, eps)
    return (h @ model.output_layer.weight.T).transpose(0, 1)


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def make(dtype=F64, mha=False, norm="pre", mixer="moda", **options):
    run = tiny_run(mixer, **options)
    if mha:
        run.model.num_query_groups = run.model.num_attention_heads
    run.model.norm_position = norm
    return build_model(run, dtype=dtype)


def perturb(model, seed=0):
    """Move every norm gain off 1 so their gradients are generic (same draws per name)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "layernorm" in name or "post_norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def depth_param_count(model):
    return sum(p.numel() for n, p in model.named_parameters()
               if ".depth_mixer.proj." in n or ".mlp_depth_kv.proj." in n)


# ---------------------------------------------------------------------------------------
# 1. Vectorised == slow reference (forward and every parameter gradient, fp64)
# ---------------------------------------------------------------------------------------

OPTION_GRID = [
    pytest.param(ffn, attn, window, norm, id=f"ffn{int(ffn)}-attn{int(attn)}-w{window}-{norm}")
    for ffn in (True, False)
    for attn in (False, True)
    for window in (None, 3)
    for norm in ("pre", "post")
]


@pytest.mark.parametrize("mha", [False, True], ids=["gqa", "mha"])
@pytest.mark.parametrize("ffn,attn,window,norm", OPTION_GRID)
def test_matches_slow_reference_fp64(megatron_single, ffn, attn, window, norm, mha):
    model = perturb(make(mha=mha, norm=norm, ffn_kv_proj=ffn, attn_kv_proj=attn,
                         depth_window=window))
    ids = ids_for()
    fast, g_fast = loss_and_grads(model, lambda: model(ids), ids)
    slow, g_slow = loss_and_grads(model, lambda: reference_logits(model, ids, window), ids)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    assert set(g_fast) == set(g_slow)
    assert len(g_fast) == sum(1 for _ in model.parameters()), "every parameter gets a gradient"
    for name in g_slow:
        torch.testing.assert_close(g_fast[name], g_slow[name], rtol=1e-9, atol=1e-12, msg=name)


def test_looped_transformer_matches_reference(megatron_single):
    """Depth sources index the unrolled layers; the loops share the projections."""
    run = tiny_run("moda", depth_window=5)
    run.model.num_layers, run.model.n_loops = 2, 2
    model = perturb(build_model(run, dtype=F64))
    ids = ids_for(seq=8)
    fast, g_fast = loss_and_grads(model, lambda: model(ids), ids)
    slow, g_slow = loss_and_grads(model, lambda: reference_logits(model, ids, 5), ids)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    for name in g_slow:
        torch.testing.assert_close(g_fast[name], g_slow[name], rtol=1e-9, atol=1e-12, msg=name)
    # both unique layers' MLPs write a read entry at loop 0 -> both have a projection
    assert all(layer.mlp_depth_kv.proj is not None for layer in model.decoder.layers)


# ---------------------------------------------------------------------------------------
# 2. Invariants
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ffn,attn", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_depth_masked_out_equals_vanilla(megatron_single, monkeypatch, ffn, attn, norm):
    """Same seed -> the weights MoDA shares with vanilla are identical; with no depth entry
    visible to any layer, MoDA is vanilla attention exactly."""
    vanilla = make(mixer="vanilla", norm=norm)
    model = make(norm=norm, ffn_kv_proj=ffn, attn_kv_proj=attn)
    shared = dict(vanilla.named_parameters())
    for name, p in model.named_parameters():
        if name in shared:
            assert torch.equal(p, shared[name]), name
    ids = ids_for()
    with torch.no_grad():
        ref = vanilla(ids)
        assert not torch.allclose(model(ids), ref, atol=1e-6), "depth entries must matter"
        monkeypatch.setattr(MoDAGeometry, "visible", lambda self, layer: ())
        assert torch.equal(model(ids), ref)


@pytest.mark.parametrize("ffn,attn", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_extra_parameters_closed_form(megatron_single, ffn, attn, qk_norm):
    """Per projection family: (L - 1) projections (the last layer's entries are never read;
    the MoDA paper variants table: 705.7M - 669.0M = 35 * 2 * 1024 * 512 for its 36 layers), each
    ``2 * hidden * ng * hn`` weights plus the depth keys' ``hn`` QK-norm gain."""
    run = tiny_run("moda", ffn_kv_proj=ffn, attn_kv_proj=attn)
    run.model.qk_layernorm = qk_norm
    model = build_model(run, dtype=F64)
    base = tiny_run("vanilla")
    base.model.qk_layernorm = qk_norm
    vanilla = build_model(base, dtype=F64)
    m = run.model
    L, hidden, ng = m.num_layers, m.hidden_size, m.num_query_groups
    hn = m.hidden_size // m.num_attention_heads
    per_projection = 2 * hidden * ng * hn + (hn if qk_norm else 0)
    expected = (L - 1) * per_projection * (int(ffn) + int(attn))
    total = lambda mdl: sum(p.numel() for p in mdl.parameters())  # noqa: E731
    assert total(model) - total(vanilla) == expected == depth_param_count(model)


def test_window_drops_unread_projections(megatron_single):
    """With depth_window=2 and FFN entries, layer l reads attn(l-1) and mlp(l-1) only."""
    geo = MoDAGeometry(4, 1, True, 2)
    for layer in range(1, 4):
        assert [s.name for s in geo.visible(layer)] == [f"attn{layer - 1}", f"mlp{layer - 1}"]
    model = make(ffn_kv_proj=True, attn_kv_proj=True, depth_window=2)
    m = tiny_run("moda").model
    per = 2 * m.hidden_size * m.num_query_groups * (m.hidden_size // m.num_attention_heads) + 16
    assert depth_param_count(model) == 2 * 3 * per


# ---------------------------------------------------------------------------------------
# RoPE / QK-norm convention: depth scores do not depend on the absolute position
# ---------------------------------------------------------------------------------------


def shifted_logits(model, ids, shift):
    """The same tokens placed at positions ``shift .. shift + s - 1`` (an empty KV cache
    whose offset is ``shift``): sequence attention only sees relative positions."""
    cache = KVCache()
    cache.offset = shift
    with torch.no_grad():
        return model(ids, inference=cache)


@pytest.mark.parametrize("options", [{}, {"attn_kv_proj": True}, {"ffn_kv_proj": False}],
                         ids=["ffn", "ffn+attn", "reuse-only"])
def test_depth_scores_do_not_depend_on_absolute_position(megatron_single, options):
    """Shifting every position leaves the logits unchanged up to the fp32 RoPE angles
    (Megatron computes the frequencies in fp32: vanilla moves by ~1e-7 as well; keeping
    projected depth keys un-rotated moves them by ~1e-1, see the next test)."""
    model = perturb(make(**options)).eval()
    ids = ids_for()
    with torch.no_grad():
        ref = model(ids)
    for shift in (1, 37):
        torch.testing.assert_close(shifted_logits(model, ids, shift), ref, rtol=0, atol=1e-5)


def test_unrotated_projected_depth_keys_would_break_the_invariance(megatron_single, monkeypatch):
    """Negative control: keeping projected depth keys before RoPE (while queries are
    rotated) makes the depth scores depend on the absolute position."""
    model = perturb(make(attn_kv_proj=True)).eval()
    ids = ids_for()
    monkeypatch.setattr(moda_mod, "apply_rope", lambda t, ctx, config: t)
    with torch.no_grad():
        ref = model(ids)
    assert (shifted_logits(model, ids, 37) - ref).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------


def test_statistics_match_the_reference(megatron_single):
    model = perturb(make(depth_window=3)).eval()
    ids = ids_for()
    stats, ref = {}, []
    with torch.no_grad():
        model(ids, stats=stats)
        reference_logits(model, ids, 3, stats=ref)
    geo = MoDAGeometry.from_config(model.config)
    L = model.config.num_layers
    for layer in range(L):
        mass, seq = stats[f"layer{layer}/moda_depth_mass"], stats[f"layer{layer}/moda_seq_mass"]
        per_source = stats[f"layer{layer}/moda_source_weights"]
        assert per_source.shape == (2 * L,)
        torch.testing.assert_close(mass + seq, torch.tensor(1.0))
        cols = [s.stat_index for s in geo.visible(layer)]
        torch.testing.assert_close(per_source[cols], ref[layer].float(), rtol=1e-5, atol=1e-7)
        others = [i for i in range(2 * L) if i not in cols]
        assert torch.all(per_source[others] == 0)
        torch.testing.assert_close(mass, per_source.sum())
    assert stats["layer0/moda_depth_mass"] == 0 and stats["layer2/moda_depth_mass"] > 0


# ---------------------------------------------------------------------------------------
# The plan (exact readers) and the pipeline bytes it implies
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ffn,window,loops", [(True, None, 1), (True, 3, 1), (False, 2, 1),
                                              (True, 1, 1), (True, 4, 2)])
def test_plan_readers_are_exactly_the_windows(megatron_single, ffn, window, loops):
    run = tiny_run("moda", ffn_kv_proj=ffn, depth_window=window)
    run.model.n_loops = loops
    from depthmix.megatron_ext.config import to_transformer_config

    config = to_transformer_config(run)
    entries = {e.name: e for e in moda_plan(config, tp=1)}
    n = config.unrolled_layers
    written = []  # (name, writer) in write order
    reads = {}
    for layer in range(n):
        for name, _ in (written[-window:] if window else written):
            reads.setdefault(name, []).append(layer)
        written.append((f"attn{layer}", layer))
        if ffn:
            written.append((f"mlp{layer}", layer))
    for name, writer in written:
        for kv in ("k", "v"):
            key = f"moda_{kv}_{name}"
            if name not in reads:
                assert key not in entries, f"{key} is never read and must not be stored"
                continue
            e = entries[key]
            assert e.writers == (writer,) and list(e.readers) == reads[name], key
            assert e.shape == (config.num_query_groups, config.kv_channels) and not e.seq_sharded
    assert len(entries) == 1 + 2 * len(reads)


def closed_form_bytes(run, chunk, layout, tp, sp, elem=4):
    """docs/methods/moda.md: hidden + 2 * (#window entries new to the receiver) * KV heads."""
    m, b = run.model, run.train.micro_batch_size
    s, h, hn = m.seq_length, m.hidden_size, m.hidden_size // m.num_attention_heads
    per_source = 1 + int(run.mixer.ffn_kv_proj)
    w = run.mixer.depth_window or math.inf
    p = layout.start(chunk)
    held = layout.end(chunk - layout.pp) if chunk - layout.pp >= 0 else 0
    entries = min(w, per_source * (p - held))
    hidden = (s // tp if sp else s) * h
    return elem * b * (hidden + 2 * entries * s * (m.num_query_groups // tp) * hn)


@pytest.mark.parametrize("pp,vp,tp,sp", [(2, 1, 1, False), (4, 1, 1, False), (2, 2, 1, False),
                                         (2, 1, 2, True), (2, 2, 2, True)])
@pytest.mark.parametrize("options", [{}, {"depth_window": 3}, {"ffn_kv_proj": False},
                                     {"depth_window": 1}])
def test_pipeline_bytes_closed_form(megatron_single, pp, vp, tp, sp, options):
    from depthmix.megatron_ext.config import to_transformer_config

    run = tiny_run("moda", **options)
    run.parallel.tp, run.parallel.pp, run.parallel.vp = tp, pp, (vp if vp > 1 else None)
    run.parallel.sequence_parallel = sp
    validate(run)
    config = to_transformer_config(run)
    layout = PipelineLayout(config.num_layers, pp, vp)
    geo = geometry_of(moda_plan, config, layout, tp)
    for chunk in range(1, layout.num_chunks):
        assert geo.payload_bytes(chunk, run.train.micro_batch_size, 4) == \
            closed_form_bytes(run, chunk, layout, tp, sp), f"chunk {chunk}"


# ---------------------------------------------------------------------------------------
# 3. Config validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("options,model,match", [
    ({"depth_window": 0}, {}, r"mixer\.depth_window=0 must be >= 1"),
    ({"depth_window": -3}, {}, r"mixer\.depth_window=-3"),
    ({"depth_window": 2.5}, {}, r"mixer\.depth_window=2\.5"),
    ({"depth_window": True}, {}, r"mixer\.depth_window=True"),
    ({"ffn_kv_proj": "yes"}, {}, r"mixer\.ffn_kv_proj='yes'"),
    ({"attn_kv_proj": 1}, {}, r"mixer\.attn_kv_proj=1"),
    ({"attn_kv_proj": True, "depth_window": 1}, {}, r"mixer\.attn_kv_proj=true .*depth_window=1"),
    ({"impl": "cuda"}, {}, r"mixer\.impl='cuda'"),
    ({"moda_kernel": "fuse"}, {}, r"mixer\.moda_kernel='fuse'.*fused"),
    ({}, {"num_layers": 1}, r"mixer=moda needs at least 2"),
])
def test_bad_configs_raise(options, model, match):
    with pytest.raises(ConfigError, match=match):
        run = tiny_run("moda", **options)  # resolves mixer.impl
        for key, value in model.items():
            setattr(run.model, key, value)
        validate(run)


def test_defined_edge_configs_validate():
    validate(tiny_run("moda", depth_window=1))  # previous MLP entry only
    validate(tiny_run("moda", depth_window=1, ffn_kv_proj=False, attn_kv_proj=True))
    validate(tiny_run("moda", depth_window=100))  # larger than the depth: keeps everything


def test_yaml_and_unknown_options():
    from depthmix.config.load import compose_run, resolve

    run = compose_run("mixer=moda", "mixer.depth_window=4", "mixer.impl=torch")
    assert (run.mixer.name, run.mixer.ffn_kv_proj, run.mixer.attn_kv_proj,
            run.mixer.depth_window, run.mixer.moda_kernel) == ("moda", True, False, 4, "split")
    assert compose_run("mixer=moda", "mixer.moda_kernel=fused").mixer.moda_kernel == "fused"
    with pytest.raises(ConfigError, match=r"mixer\.depth_windw"):
        resolve(OmegaConf.create({"mixer": {"name": "moda", "depth_windw": 3}}))
    with pytest.raises(ConfigError, match="depth_window"):
        resolve(OmegaConf.create({"mixer": {"name": "moda", "depth_window": "all"}}))
