"""FLOPs per token against torch's FLOP counter on the real model, parameter counts against
the built model, the peak-FLOP table, MFU arithmetic and the pipeline in-flight formula."""

import types

import pytest
import torch

from depthmix.pretrain import accounting as acc
from depthmix.testing import build_model, tiny_run


def test_flops_match_torch_flop_counter(megatron_single):
    """Every matmul of a forward (QKV, output projection, SwiGLU, LM head) is in the
    formula, exactly; backward is exactly 2x forward. (CPU SDPA is invisible to the
    counter, so the attention term is checked against its closed form.)"""
    from torch.utils.flop_counter import FlopCounterMode

    run = tiny_run()
    model = build_model(run)
    b, s = 2, run.model.seq_length
    ids = torch.randint(0, run.model.vocab_size, (b, s))
    f = acc.flops_per_token(run)
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
    once = acc.flops_per_token(run)
    run.model.n_loops = 3
    looped = acc.flops_per_token(run)
    assert looped["linear"] == 3 * once["linear"] and looped["attention"] == 3 * once["attention"]
    assert looped["head"] == once["head"]


def test_mixer_hook_is_added(monkeypatch):
    from depthmix.megatron_ext.mixers import base, get_mixer

    run = tiny_run()
    plain = acc.flops_per_token(run)
    vanilla = get_mixer("vanilla")
    patched = base.Mixer(vanilla.name, vanilla.config_cls, vanilla.model_spec, vanilla.plan,
                         extra_flops_per_token=lambda config: 1000.0 * config.num_layers)
    monkeypatch.setattr(acc, "_mixer", lambda run: patched)
    f = acc.flops_per_token(run)
    assert f["mixer"] == 4000.0 and f["train"] == plain["train"] + 3 * 4000.0


def test_parameter_count_matches_the_model(megatron_single):
    run = tiny_run()
    model = build_model(run)
    numel = sum(p.numel() for p in model.parameters())
    assert acc.total_params(run) == numel
    (only,) = acc.estimate(run, world_size=1)
    assert only.params == numel


def test_peak_table_and_mfu():
    run = tiny_run()
    run.train.precision = "bf16"
    assert acc.device_peak_tflops(run, "NVIDIA H100 80GB HBM3") == 989.4
    assert acc.device_peak_tflops(run, "NVIDIA H100 PCIe") == 756.0
    assert acc.device_peak_tflops(run, "NVIDIA H200") == 989.4
    assert acc.device_peak_tflops(run, "NVIDIA A100-SXM4-80GB") == 312.0
    assert acc.device_peak_tflops(run, "Some CPU") is None
    run.train.peak_tflops = 100.0
    assert acc.device_peak_tflops(run, "NVIDIA H100") == 100.0
    trainer = types.SimpleNamespace(run=run, config=None, tokens_per_step=1000,
                                    topo=types.SimpleNamespace(world_size=4))
    trainer._train_flops_per_token, trainer._peak_tflops = 6e9, 100.0
    perf = acc.throughput(trainer, 0.5)  # 2000 tokens/s x 6 GFLOP over 4 devices = 3 TFLOP/s
    assert perf.tokens_per_s == 2000 and perf.tflops_per_device == pytest.approx(3.0)
    assert perf.mfu == pytest.approx(0.03)


def test_inflight_microbatches():
    # 1F1B: stage r keeps pp - r micro-batches; never more than there are
    assert [acc.inflight_microbatches(4, 1, r, 32) for r in range(4)] == [4, 3, 2, 1]
    assert acc.inflight_microbatches(4, 1, 0, 2) == 2
    # interleaved (Megatron's warm-up count + 1)
    assert acc.inflight_microbatches(4, 2, 0, 32) == (4 - 1) * 2 + 4 + 1
