"""Attention Residuals (Full and Block): the vectorised mixer against a slow reference
written from the paper's equations, the paper's invariants, the plan and the
pipeline transport it implies (cross-stage caching). (Decoding and recomputation:
test_conformance.py.)"""

import math

import pytest
import torch
from resop_reference import (
    attention_sublayer,
    context,
    embed,
    ids_for,
    lm_logits,
    loss_and_grads,
    mlp_sublayer,
)

from depthmix.config.schema import ConfigError
from depthmix.config.validate import validate
from depthmix.planning.depth_plan import DepthPlan
from depthmix.planning.pipeline import PipelineLayout, TransportGeometry
from depthmix.mixers.attnres import AttnResGeometry
from depthmix.testing import build_model, tiny_run

F64 = torch.float64


# ---------------------------------------------------------------------------------------
# Slow reference: loops over sublayers, positions and sources
# ---------------------------------------------------------------------------------------


def slow_rmsnorm(v, gain, eps):
    return v / torch.sqrt((v * v).mean() + eps) * gain


def slow_depth_attention(sources, query, gain, eps):
    """h[t, n] = sum_s a_s y_s[t, n], a = softmax_s(w . RMSNorm(y_s[t, n])), one token at a time."""
    seq, batch, _ = sources[0].shape
    rows = []
    for t in range(seq):
        cols = []
        for n in range(batch):
            scores = [torch.exp(torch.dot(query, slow_rmsnorm(y[t, n], gain, eps)))
                      for y in sources]
            total = sum(scores)
            cols.append(sum(a / total * y[t, n] for a, y in zip(scores, sources)))
        rows.append(torch.stack(cols))
    return torch.stack(rows)


def reference_logits(model, ids, block_size=None):
    """Full AttnRes (``block_size=None``) from Eq. (7) of Su's Attention Residuals memoir, or Block AttnRes from
    its description: the embedding is block 0, outputs are summed inside a block, a
    sublayer attends over the completed blocks plus its block's (non-empty) partial sum."""
    emb, ctx = embed(model, ids), context(model, ids.shape[1])
    outputs = [emb]  # Full: y_0 .. y_{i-1}
    blocks, partial = [emb], None  # Block
    count = 0

    def read(op):
        rd = op.read_op
        if block_size is None:
            sources = outputs
        else:
            sources = blocks + ([partial] if partial is not None else [])
        return slow_depth_attention(sources, rd.query, rd.key_norm.weight, rd.key_norm.eps)

    for u, layer in model.decoder.unrolled():
        ctx.layer = u
        for which, op in (("attn", layer.attn_residual), ("mlp", layer.mlp_residual)):
            x = read(op)
            y = attention_sublayer(layer, x, ctx) if which == "attn" else mlp_sublayer(layer, x)
            count += 1
            outputs.append(y)
            partial = y if partial is None else partial + y
            if block_size is not None and count % block_size == 0:
                blocks.append(partial)
                partial = None
    return lm_logits(model, read(model.head))


def perturb(model, seed=0):
    """Move the AttnRes parameters off their init (same draws for every model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("read_op.query"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("read_op.key_norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def make(mixer, dtype=F64, mha=False, n_loops=1, eps=None, **options):
    run = tiny_run(mixer, **options)
    if mha:
        run.model.num_query_groups = run.model.num_attention_heads
    run.model.n_loops = n_loops
    if options.get("block_size", 0) is None:  # derived from num_blocks: at the looped depth
        run.mixer.block_size = None
        run.mixer.resolve(run.model)
    if eps is not None:
        run.model.norm_epsilon = eps
    return build_model(run, dtype=dtype)


TWO_CASES = [("attnres_full", {}), ("attnres_block", {"block_size": 4})]

CASES = [
    pytest.param("attnres_full", {}, False, 1, id="full-gqa"),
    pytest.param("attnres_full", {}, True, 1, id="full-mha"),
    pytest.param("attnres_full", {}, False, 2, id="full-loops2"),
    pytest.param("attnres_block", {"block_size": 1}, False, 1, id="block1"),
    pytest.param("attnres_block", {"block_size": 2}, False, 1, id="block2-gqa"),
    pytest.param("attnres_block", {"block_size": 2}, True, 1, id="block2-mha"),
    pytest.param("attnres_block", {"block_size": 4}, False, 1, id="block4"),
    pytest.param("attnres_block", {"block_size": 8}, True, 1, id="block8-mha"),
    pytest.param("attnres_block", {"block_size": 3}, False, 3, id="block3-loops3"),
    pytest.param("attnres_block", {"block_size": 3}, False, 1, id="block3-ragged"),
    pytest.param("attnres_block", {"num_blocks": 2, "block_size": None}, True, 2,
                 id="2blocks-of-8"),
    pytest.param("attnres_block", {"num_blocks": 3, "block_size": None}, False, 2,
                 id="3blocks-ragged"),
]


@pytest.mark.parametrize("mixer,options,mha,n_loops", CASES)
def test_matches_slow_reference_fp64(megatron_single, mixer, options, mha, n_loops):
    model = perturb(make(mixer, mha=mha, n_loops=n_loops, **options))
    ids = ids_for()
    block = model.config.mixer.block_size if mixer == "attnres_block" else None
    if "num_blocks" in options:
        assert AttnResGeometry.from_config(model.config).num_blocks == options["num_blocks"]
    fast, g_fast = loss_and_grads(model, lambda: model(ids), ids)
    slow, g_slow = loss_and_grads(model, lambda: reference_logits(model, ids, block), ids)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    assert set(g_fast) == set(g_slow) and any("read_op.query" in n for n in g_fast)
    for name in g_slow:
        torch.testing.assert_close(g_fast[name], g_slow[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("options", [{"block_size": 1}, {"num_blocks": 8, "block_size": None}],
                         ids=["block_size=1", "num_blocks=sublayers"])
def test_block_size_one_equals_full(megatron_single, options):
    full = perturb(make("attnres_full"))
    block = perturb(make("attnres_block", **options))
    assert block.config.mixer.block_size == 1  # 8 sublayers in 8 blocks
    ids = ids_for()
    a, ga = loss_and_grads(full, lambda: full(ids), ids)
    b, gb = loss_and_grads(block, lambda: block(ids), ids)
    assert torch.equal(a, b)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
    # and the two slow references agree with each other
    torch.testing.assert_close(reference_logits(full, ids), reference_logits(full, ids, 1),
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("mixer,options", TWO_CASES)
def test_uniform_weights_at_init(megatron_single, mixer, options):
    model = make(mixer, **options)
    geo = AttnResGeometry.from_config(model.config)
    stats = {}
    with torch.no_grad():
        model(ids_for(), stats=stats)
    expected = {}
    for layer in range(model.config.num_layers):
        for which in ("attn", "mlp"):
            expected[f"layer{layer}/attnres_{which}"] = len(geo.sources(geo.sublayer(layer, which)))
    expected["head/attnres"] = len(geo.sources(geo.head))
    assert set(stats) == set(expected)
    for key, count in expected.items():
        torch.testing.assert_close(stats[key], torch.full((count,), 1.0 / count), msg=key)


@pytest.mark.parametrize("mixer,options", [("attnres_full", {}),
                                           ("attnres_block", {"block_size": 2}),
                                           ("attnres_block", {"block_size": 8})])
def test_at_init_equals_plain_residual_up_to_norm_epsilon(megatron_single, mixer, options):
    """Zero queries give the uniform average of the sources, i.e. the residual sum / S;
    the pre-norm removes the 1/S (Su, Attention Residuals memoir: averaging and summing are equivalent)."""
    ids = ids_for()
    vanilla = make("vanilla", eps=1e-30)
    model = make(mixer, eps=1e-30, **options)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), vanilla(ids), rtol=1e-10, atol=1e-12)


def test_parameters_marked_for_sp_and_no_weight_decay(megatron_single):
    model = make("attnres_block", block_size=2)
    mixing = [(n, p) for n, p in model.named_parameters() if ".read_op." in n]
    # two reads per layer and the head's, each a query and a key-norm gain
    assert len(mixing) == 2 * (2 * model.config.num_layers + 1)
    for name, p in mixing:
        assert p.no_weight_decay is True, name
        assert p.sequence_parallel is model.config.sequence_parallel, name
    assert all(torch.all(p == 0) for n, p in mixing if n.endswith("query"))


def test_validation_names_the_option():
    validate(tiny_run("attnres_block", block_size=3))  # 8 sublayers: blocks of 3, 3, 2
    run = tiny_run("attnres_block", block_size=9)
    with pytest.raises(ConfigError, match="mixer.block_size=9"):
        validate(run)
    run = tiny_run("attnres_block", block_size=0)
    with pytest.raises(ConfigError, match="mixer.block_size=0"):
        validate(run)
    run = tiny_run("attnres_block", num_blocks=0)
    with pytest.raises(ConfigError, match="mixer.num_blocks=0"):
        validate(run)
    run = tiny_run("attnres_block", block_size=9)
    run.model.n_loops = 3  # 24 sublayers
    validate(run)
    run = tiny_run("attnres_full")
    run.model.norm_position = "post"
    with pytest.raises(ConfigError, match="model.norm_position"):
        validate(run)


# ---------------------------------------------------------------------------------------
# Plan: what is live at each layer boundary, and what pipeline transitions carry
# ---------------------------------------------------------------------------------------


def expected_live(boundary, block_size, num_sublayers):
    """Entering layer ``boundary``, ``2 * boundary`` sublayers are done: the completed
    blocks so far, and the partial sum of the open block if it is not empty."""
    done = 2 * boundary
    completed = done // block_size + (done == num_sublayers and num_sublayers % block_size > 0)
    names = {("y" if block_size == 1 else "b") + str(k) for k in range(completed + 1)}
    if done % block_size and done < num_sublayers:
        names.add(f"p{done // block_size + 1}")
    return names


@pytest.mark.parametrize("layers,block_size",
                         [(4, 1), (4, 2), (4, 8), (6, 4), (6, 3), (12, 12), (5, 5),
                          (4, 3), (6, 5), (5, 4), (3, 4)])
def test_plan_is_exact(layers, block_size):
    geo = AttnResGeometry(2 * layers, block_size)
    plan = DepthPlan(geo.entries(64), layers)
    for boundary in range(layers + 1):
        expected = expected_live(boundary, block_size, 2 * layers)
        assert plan.live_names(boundary) == expected, boundary
    # the seed-001 matrix view with m = 3: sublayer 4 opens block 2 and reads b0, b1 only
    m3 = AttnResGeometry(6, 3)
    assert [m3.sources(i) for i in range(1, 8)] == [
        ["b0"], ["b0", "p1"], ["b0", "p1"], ["b0", "b1"], ["b0", "b1", "p2"],
        ["b0", "b1", "p2"], ["b0", "b1", "b2"]]
    # ragged: 5 sublayers in blocks of 2, 2, 1; the head reads the three completed blocks
    ragged = AttnResGeometry(5, 2)
    assert ragged.num_blocks == 3
    assert [ragged.sources(i) for i in range(1, 7)] == [
        ["b0"], ["b0", "p1"], ["b0", "b1"], ["b0", "b1", "p2"], ["b0", "b1", "b2"],
        ["b0", "b1", "b2", "b3"]]


def transport(layers, block_size, pp, vp, seq=16, hidden=64, tp=1, sp=False):
    geo = AttnResGeometry(2 * layers, block_size)
    return TransportGeometry(plan=DepthPlan(geo.entries(hidden), layers),
                             layout=PipelineLayout(layers, pp, vp), seq_length=seq,
                             hidden_size=hidden, tp=tp, sequence_parallel=sp)


def held_by_receiver(layout, chunk, block_size):
    """Blocks the rank running ``chunk`` already holds: it produced or received every
    block completed before the end of its previous chunk ``chunk - P``."""
    prev = chunk - layout.pp
    if prev < 0:
        return set()
    return {("y" if block_size == 1 else "b") + str(k)
            for k in range(2 * layout.end(prev) // block_size + 1)}


@pytest.mark.parametrize("layers,block_size,pp,vp", [
    (8, 2, 2, 2), (12, 4, 2, 2), (12, 1, 2, 2), (16, 4, 2, 4), (8, 2, 4, 1), (12, 3, 4, 1),
    (16, 8, 4, 2), (12, 5, 2, 2), (8, 3, 4, 1)])
def test_transitions_send_only_blocks_new_to_the_receiver(layers, block_size, pp, vp):
    geo = transport(layers, block_size, pp, vp)
    layout = geo.layout
    total_sent = total_resend = 0
    for chunk in range(1, layout.num_chunks):
        live = expected_live(layout.start(chunk), block_size, 2 * layers)
        sent = {e.name for e in geo.sent_into(chunk)}
        assert sent == live - held_by_receiver(layout, chunk, block_size), chunk
        # the receiver's cache holds exactly the rest
        prev = chunk - layout.pp
        cached = {e.name for e in geo.cached_after(prev)} if prev >= 0 else set()
        assert cached == live - sent, chunk
        total_sent += len(sent)
        total_resend += len(live)
    saving = total_resend / total_sent
    if vp == 1:
        assert saving == 1.0  # no later chunk on the receiver: nothing to cache
    else:
        assert saving > 1.0


def test_cross_stage_caching_saving_factor_closed_form():
    """8 layers, blocks of 2 sublayers, pp=2 x vp=2 (chunks of 2 layers = 2 blocks):
    without caching chunk c receives blocks b0..b2c (3 + 5 + 7 = 15 blocks); with it,
    chunk 1 receives b0..b2 and chunks 2, 3 only the two blocks made since (3 + 2 + 2)."""
    geo = transport(8, 2, pp=2, vp=2)
    sent = [len(geo.sent_into(c)) for c in (1, 2, 3)]
    resent = [len(geo.plan.live_at(geo.layout.start(c))) for c in (1, 2, 3)]
    assert sent == [3, 2, 2] and resent == [3, 5, 7]
    assert math.isclose(sum(resent) / sum(sent), 15 / 7)
    # bytes per transition: e * b * (s / tp under SP) * h per block
    sp = transport(8, 2, pp=2, vp=2, seq=16, hidden=64, tp=2, sp=True)
    assert sp.payload_bytes(2, micro_batch_size=3, element_size=2) == 2 * 3 * 8 * 64 * 2


# ---------------------------------------------------------------------------------------
# Two-phase inference (Block AttnRes through a KV cache)
# ---------------------------------------------------------------------------------------


def decode_with_counters(model, ids, prefill=3):
    """Logits of a prefill then one token at a time, and the cache's read counters per
    forward (each forward's count is per token)."""
    from depthmix.inference import KVCache

    cache, outs = KVCache(), []
    with torch.no_grad():
        outs.append(model(ids[:, :prefill], inference=cache))
        cache.advance(prefill)
        for t in range(prefill, ids.shape[1]):
            outs.append(model(ids[:, t:t + 1], inference=cache))
            cache.advance(1)
    forwards = 1 + ids.shape[1] - prefill
    counts = {k: v / forwards for k, v in cache.counters.items()}
    return torch.cat(outs, dim=1), counts


TWO_PHASE_CASES = [
    pytest.param(1, 1, id="block1"),
    pytest.param(2, 1, id="block2"),
    pytest.param(4, 1, id="block4"),
    pytest.param(8, 1, id="block8-one-block"),
    pytest.param(3, 3, id="block3-loops3-straddles-layers"),
    pytest.param(6, 3, id="block6-loops3"),
    pytest.param(3, 1, id="block3-ragged"),
    pytest.param(5, 1, id="block5-ragged"),
]


@pytest.mark.parametrize("block_size,n_loops", TWO_PHASE_CASES)
def test_two_phase_decode_equals_per_sublayer_reads_fp64(megatron_single, block_size, n_loops):
    two = perturb(make("attnres_block", n_loops=n_loops, block_size=block_size)).eval()
    plain = perturb(make("attnres_block", n_loops=n_loops, block_size=block_size,
                         two_phase=False)).eval()
    ids = ids_for()
    a, reads_two = decode_with_counters(two, ids)
    b, reads_plain = decode_with_counters(plain, ids)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(a, two(ids), rtol=1e-10, atol=1e-12)
    geo = AttnResGeometry.from_config(two.config)
    assert reads_two == dict(zip(("attnres/source_reads", "attnres/block_reads"),
                                 geo.source_reads(two_phase=True)))
    assert reads_plain == dict(zip(("attnres/source_reads", "attnres/block_reads"),
                                   geo.source_reads(two_phase=False)))


@pytest.mark.parametrize("layers,block_size", [(4, 4), (6, 12), (8, 4), (24, 12)])
def test_two_phase_reads_each_completed_block_once_per_block(layers, block_size):
    """Per sublayer, the plain path reads all ``k`` completed blocks; two-phase reads them
    once per block: ``m`` times fewer completed-block reads (the head reads every block once
    in both), and the same partial-sum reads."""
    geo = AttnResGeometry(2 * layers, block_size)
    total_two, blocks_two = geo.source_reads(two_phase=True)
    total_plain, blocks_plain = geo.source_reads(two_phase=False)
    head = geo.block_of(geo.head)
    assert blocks_plain - head == block_size * (blocks_two - head)
    assert total_plain - blocks_plain == total_two - blocks_two  # partial sums, both
    nb = 2 * layers // block_size  # blocks 1..nb, block k's sublayers read k blocks
    assert blocks_two - head == nb * (nb + 1) // 2


def test_two_phase_merge_with_a_partially_filled_block_fp64():
    """The op: for every fill of the current block (no partial sum yet, 1 .. m-1 outputs
    summed), phase 1 + phase 2 equals one softmax over the completed blocks and the partial."""
    from depthmix.kernels.attnres import attnres_reference
    from depthmix.kernels.attnres.two_phase import inter_block_partials, merge_partial

    g = torch.Generator().manual_seed(0)
    m, d, eps = 5, 32, 1e-6
    blocks = [torch.randn(3, 2, d, generator=g, dtype=F64) * (j + 1) for j in range(3)]
    queries = torch.randn(m, d, generator=g, dtype=F64)
    gains = 1 + 0.3 * torch.randn(m, d, generator=g, dtype=F64)
    partials = inter_block_partials(blocks, queries, gains, eps)
    partial = None
    for row in range(m):
        got = merge_partial(partials, row, partial, queries[row], gains[row], eps, F64)
        sources = blocks + ([partial] if partial is not None else [])
        want = attnres_reference(sources, queries[row], gains[row], eps)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        y = torch.randn(3, 2, d, generator=g, dtype=F64) * 4
        partial = y if partial is None else partial + y
