"""FLOPs per token against torch's FLOP counter on the real model, parameter counts against
the built model (whole and per pipeline stage and TP rank, every mixer), the peak-FLOP
table, MFU arithmetic and the pipeline in-flight formula."""

import dataclasses
from functools import lru_cache

import pytest
import torch

from depthmix.mixers import mixer_of
from depthmix.mixers.base import Variant
from depthmix.planning import flops as acc
from depthmix.planning import memory
from depthmix.testing import build_model, tiny_run, variant_cases, variant_run


def test_flops_match_torch_flop_counter(megatron_single):
    """Every matmul of a forward (QKV, output projection, SwiGLU, LM head) is in the
    formula, exactly; backward is exactly 2x forward. (CPU SDPA is invisible to the
    counter, so the attention term is checked against its closed form.)"""
    from torch.utils.flop_counter import FlopCounterMode

    run = tiny_run()
    model = build_model(run)
    b, s = 2, run.model.seq_length
    ids = torch.randint(0, run.model.vocab_size, (b, s))
    f = acc.flops_per_token(run, mixer_of(run))
    with FlopCounterMode(display=False) as counter:
        model(ids)
    assert counter.get_total_flops() == (f["linear"] + f["head"]) * b * s
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).sum().backward()
    assert counter.get_total_flops() == 3 * (f["linear"] + f["head"]) * b * s
    m = run.model
    head_dim = m.hidden_size // m.num_attention_heads
    assert f["attention"] == 4 * m.num_layers * s * m.num_attention_heads * head_dim
    assert f["train"] == 3 * f["forward"] == 3 * (f["linear"] + f["attention"] + f["head"])


def test_looped_model_counts_unrolled_layers():
    run = tiny_run()
    once = acc.flops_per_token(run, mixer_of(run))
    run.model.n_loops = 3
    looped = acc.flops_per_token(run, mixer_of(run))
    assert looped["linear"] == 3 * once["linear"] and looped["attention"] == 3 * once["attention"]
    assert looped["head"] == once["head"]


def test_mixer_hook_is_added():
    from depthmix.mixers import base, get_mixer

    run = tiny_run()
    vanilla = get_mixer("vanilla")
    plain, plain_params = acc.flops_per_token(run, vanilla), acc.total_params(run, vanilla)
    patched = dataclasses.replace(
        vanilla, extra_flops_per_token=lambda config: 1000.0 * config.num_layers,
        extra_params=lambda config, tp=1: base.ExtraParams(
            layers=tuple(range(config.num_layers)), stem=7, head=11))
    f = acc.flops_per_token(run, patched)
    assert f["mixer"] == 4000.0 and f["train"] == plain["train"] + 3 * 4000.0
    assert acc.total_params(run, patched) == plain_params + (0 + 1 + 2 + 3) + 7 + 11


def test_parameter_count_matches_the_model(megatron_single):
    run = tiny_run()
    model = build_model(run)
    numel = sum(p.numel() for p in model.parameters())
    assert acc.total_params(run, mixer_of(run)) == numel
    (only,) = memory.estimate(run, mixer_of(run), world_size=1)
    assert only.params == numel


def test_peak_table_and_mfu():
    run = tiny_run()
    run.train.precision = "bf16"
    assert acc.device_peak_tflops(run, "NVIDIA H100 80GB HBM3") == 989.4
    assert acc.device_peak_tflops(run, "NVIDIA H100 PCIe") == 756.0
    assert acc.device_peak_tflops(run, "NVIDIA H200") == 989.4
    assert acc.device_peak_tflops(run, "NVIDIA A100-SXM4-80GB") == 312.0
    assert acc.device_peak_tflops(run, "Some CPU") is None
    assert acc.device_peak_tflops(run, None) is None  # no GPU
    run.train.peak_tflops = 100.0
    assert acc.device_peak_tflops(run, "NVIDIA H100") == 100.0
    meter = acc.ThroughputMeter(6e9, 100.0, tokens_per_step=1000, world_size=4)
    for seconds in (0.25, 0.75):
        meter.add(seconds)
    perf = meter.read()  # 2000 tokens/s x 6 GFLOP over 4 devices = 3 TFLOP/s
    assert perf.tokens_per_s == 2000 and perf.tflops_per_device == pytest.approx(3.0)
    assert perf.mfu == pytest.approx(0.03)


def test_inflight_microbatches():
    # 1F1B: stage r keeps pp - r micro-batches; never more than there are
    assert [memory.inflight_microbatches(4, 1, r, 32) for r in range(4)] == [4, 3, 2, 1]
    assert memory.inflight_microbatches(4, 1, 0, 2) == 2
    # interleaved (Megatron's warm-up count + 1)
    assert memory.inflight_microbatches(4, 2, 0, 32) == (4 - 1) * 2 + 4 + 1


# ---------------------------------------------------------------------------------------
# Every mixer: parameters and FLOPs against the built model
# ---------------------------------------------------------------------------------------

# id -> (mixer, Variant): each mixer's ``accounting`` variants; tiny_run's model otherwise
# (4 layers, h 64, 4 heads, 2 KV groups, d_h 16, s 16).
VARIANTS = {test_id: (mixer, variant) for test_id, mixer, variant in variant_cases("accounting")}


def case_run(case: str, mixer=None):
    """The case's run; ``mixer="vanilla"``: the same model without the mixer."""
    name, variant = VARIANTS[case]
    if mixer is None:
        return variant_run(name, variant)
    return variant_run(mixer, Variant(model=variant.model))


@lru_cache(maxsize=None)
def built(variant: str, mixer=None):
    torch.manual_seed(0)
    return build_model(case_run(variant, mixer))


def _stage_params(run, model, tp: int, pp: int, vp: int):
    """The built (TP=PP=1) model's parameters, grouped as a PP=pp, VP=vp layout places
    them, counted as one rank of TP=tp holds them (``tensor_model_parallel`` ones split)."""
    from depthmix.planning.pipeline import PipelineLayout

    layout = PipelineLayout(run.model.num_layers, pp, vp)
    stage_of_layer = {i: layout.rank_of(c) for c in range(layout.num_chunks)
                      for i in layout.layers(c)}
    first, last = layout.rank_of(0), layout.rank_of(layout.num_chunks - 1)
    out = [0] * pp
    for name, p in model.named_parameters():
        n = p.numel() // tp if getattr(p, "tensor_model_parallel", False) else p.numel()
        top = name.split(".")[0]
        if name.startswith("decoder.layers."):
            out[stage_of_layer[int(name.split(".")[2])]] += n
        elif top in ("embedding", "stem"):
            out[first] += n
        elif top in ("head", "final_layernorm", "output_layer"):
            out[last] += n
        else:
            raise AssertionError(f"{name}: which pipeline stage holds it?")
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parameter_count_matches_every_mixer(megatron_single, variant):
    """The accounting's total equals the built model's parameters, and its per-stage,
    per-TP-rank estimate equals the built model's parameters grouped by stage (a mixer's
    per-layer parameters, stem and head attributed to the right stage)."""
    run = case_run(variant)
    model = built(variant)
    assert acc.total_params(run, mixer_of(run)) == sum(p.numel() for p in model.parameters())
    layers = run.model.num_layers
    for tp, pp, vp in ((1, 1, 1), (2, 2, 1), (2, 2, layers // 2)):
        run.parallel.tp, run.parallel.pp, run.parallel.vp = tp, pp, vp if vp > 1 else None
        estimate = memory.estimate(run, mixer_of(run), world_size=tp * pp)
        assert [e.params for e in estimate] == _stage_params(run, model, tp, pp, vp), (tp, pp, vp)


# What FlopCounterMode (matmul-like aten ops; SDPA is invisible on CPU) cannot see of each
# mixer's reference (torch) implementation, per token; it is checked another way:
# * depth_attn, attnres, denseformer: all of it (per-token dot products and weighted sums
#   written elementwise, or matrix-vector; DenseFormer's DWA as multiply-adds). Their hooks
#   are checked against a count of the depth op calls the forward actually makes
#   (``_record_depth_ops``: sources per call);
# * ddl: all but the value projection ``W_v x_in`` (a matmul), by hand: per sublayer the read
#   ``X r`` (mv) 2 h d_v, the gate dot 2 h, ``k^T X`` and the update (elementwise) 4 h d_v;
#   the readout 2 h d_v;
# * mhc: the post ``H_post^T y`` (elementwise outer product) 2 n h per sublayer and the
#   head's mean over the streams 2 n h;
# * ShortSWA: the window attention (SDPA) 4 min(w, s) H d_h per layer.
# Conversely, MoDA's reference attention computes the layer's sequence attention as
# einsums where a layer has depth entries: the vanilla attention term of those layers,
# which the counter sees on top of the mixer's own work.


def _record_depth_ops(model, monkeypatch):
    """Wrap the depth ops of Depth-Attention, AttnRes and DenseFormer; returns the list
    that collects each call's forward FLOPs per token, from the call's actual arguments."""
    from depthmix.mixers.denseformer import model as denseformer
    from depthmix.mixers.attnres.model import PseudoQueryRead
    from depthmix.mixers.depth_attn.model import DepthAttention

    calls = []

    def depth_attn(op):
        def wrapped(query, key, value, src_keys, src_values, *, mix_rule, mixed_state):
            n = len(src_values if src_values is not None else src_keys)
            np_, ng, hn = query.shape[2], key.shape[2], key.shape[3]
            mixed = {"value": 1, "key": 1, "key_value": 2}[mixed_state]
            if n:
                scores = 2 * (n + 1) * ng * hn + (np_ * hn if np_ > ng else 0)
                calls.append((scores if mix_rule == "softmax" else 0)
                             + mixed * 2 * (n + 1) * ng * hn)
            return op(query, key, value, src_keys, src_values, mix_rule=mix_rule,
                      mixed_state=mixed_state)
        return wrapped

    def attnres(op):
        def wrapped(sources, *args, **kwargs):
            calls.append(4 * len(sources) * sources[0].shape[-1])  # logits + weighted sum
            return op(sources, *args, **kwargs)
        return wrapped

    def dwa(op):
        def wrapped(xs, alpha):
            calls.append(2 * len(xs) * xs[0].shape[-1])  # one multiply-add per source
            return op(xs, alpha)
        return wrapped

    monkeypatch.setattr(denseformer, "depth_weighted_average",
                        dwa(denseformer.depth_weighted_average))
    for module in model.modules():
        if isinstance(module, DepthAttention):
            module.depth_mix = depth_attn(module.depth_mix)
        elif isinstance(module, PseudoQueryRead):
            module.attnres = attnres(module.attnres)
    return calls


def _counted_per_token(model, run) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    b, s = 2, run.model.seq_length
    ids = torch.randint(0, run.model.vocab_size, (b, s),
                        generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids)
    return counter.get_total_flops() / (b * s)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixer_flops_match_the_model(megatron_single, variant, monkeypatch):
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.mixers.moda import MoDAGeometry

    run = case_run(variant)
    name, _ = VARIANTS[variant]
    config = to_transformer_config(run)
    m = run.model
    h, s, heads = m.hidden_size, m.seq_length, m.num_attention_heads
    dh, L = h // heads, m.num_layers * m.n_loops
    model = built(variant)
    calls = _record_depth_ops(model, monkeypatch)
    counted = _counted_per_token(model, run) - _counted_per_token(built(variant, "vanilla"), run)
    f = acc.flops_per_token(run, mixer_of(run))

    unseen = sum(calls)  # depth_attn, attnres, denseformer
    if name == "ddl":
        dv = run.mixer.value_channels
        unseen += 2 * L * (2 * h * dv + 2 * h + 4 * h * dv) + 2 * h * dv
    elif name == "mhc":
        unseen += 2 * L * 2 * run.mixer.streams * h + 2 * run.mixer.streams * h
    window = run.mixer.short_swa_window
    if window:
        unseen += L * 4 * min(window, s) * heads * dh
    seen_besides = 0
    if name == "moda":
        geo = MoDAGeometry.from_config(config)
        seen_besides = 4 * s * heads * dh * sum(1 for u in range(L) if geo.visible(u))
        # with a single depth entry, einsum contracts the weighted depth values over a
        # size-1 axis as a broadcast multiply: invisible, 2 H d_h
        unseen += 2 * heads * dh * sum(1 for u in range(L) if len(geo.visible(u)) == 1)
    assert counted + unseen - seen_besides == f["mixer"] + f["short_swa"], (
        f"{variant}: the hooks say {f['mixer'] + f['short_swa']}, FlopCounterMode sees "
        f"{counted} (+ {unseen - seen_besides} it cannot see, written out above per mixer)")
    if name in ("depth_attn", "attnres_full", "attnres_block", "denseformer"):
        assert len(calls) > 0
    assert (f["mixer"] > 0) == (name != "vanilla")
    assert (f["short_swa"] > 0) == (window > 0)


def test_every_mixer_adds_flops_and_params_at_3b():
    """The hooks are wired for every registered mixer (the 3b preset, no model built)."""
    from depthmix.config.load import compose_run
    from depthmix.mixers import available

    from depthmix.mixers import get_mixer

    vanilla = acc.total_params(compose_run("model=3b"), get_mixer("vanilla"))
    for name in available():
        run = compose_run("model=3b", f"mixer={name}")
        f = acc.flops_per_token(run, mixer_of(run))
        extra = acc.total_params(run, mixer_of(run)) - vanilla
        if name == "vanilla":
            assert f["mixer"] == 0 and extra == 0
        else:
            assert f["mixer"] > 0, name
            assert extra > 0 or name == "depth_attn", name
