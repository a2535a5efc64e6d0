"""The accounting with experts (docs/moe.md, depthmix.planning.experts): FLOPs and MFU by
activated parameters against a hand count and torch's FLOP counter on the real MoE model,
parameters (total, activated, per pipeline stage and TP x EP rank) against the built model,
the memory model against a real step on one rank for each MoE preset (the multi-rank
layouts: test_memory_model.py), the planner's expert-parallel search and all-to-all, the
dry run's MoE memory, and what the overheads table counts with experts."""

import io

import pytest
import torch

from depthmix.config.load import compose_run
from depthmix.mixers import get_mixer, mixer_of
from depthmix.planning import flops as acc
from depthmix.planning import memory
from depthmix.planning import planner as plan
from depthmix.planning.experts import Experts
from depthmix.testing import build_model

from memory_probe import probe_one

# tiny_moe at 32 tokens: 4 layers (the first dense), h 128, 4 heads / 2 KV heads of 32,
# dense SwiGLU 352, 4 experts of 176, top-2, vocabulary 2048 (untied)
S = 32
ATTN_PROJ = 128 * (4 + 2 * 2) * 32 + 4 * 32 * 128  # QKV + output projection: 49,152
DENSE_MLP = 3 * 128 * 352  # 135,168
ROUTED = 3 * 128 * 176  # one expert: 67,584


def hand_count(shared: int = 0) -> dict:
    """Forward FLOPs per token and parameters of tiny_moe (with a shared expert of width
    ``shared``), written out: 2 FLOPs per multiply-add of every weight a token meets."""
    moe_mlp = 4 * 128 + 2 * ROUTED + 3 * 128 * shared  # router, 2 of 4 experts, shared
    linear = 2 * (4 * ATTN_PROJ + DENSE_MLP + 3 * moe_mlp)
    norms = 2 * 128 + 2 * 32  # the layer's two RMSNorms, QK-norm
    embeddings = 2 * 2048 * 128 + 128  # embedding, output layer, final norm
    moe_layer = ATTN_PROJ + norms + 4 * 128 + 4 * ROUTED + 3 * 128 * shared
    active_layer = ATTN_PROJ + norms + moe_mlp
    return {"linear": linear, "moe": 2 * 3 * moe_mlp,
            "attention": 4 * 4 * S * 4 * 32, "head": 2 * 128 * 2048,
            "total": embeddings + ATTN_PROJ + norms + DENSE_MLP + 3 * moe_layer,
            "activated": embeddings + ATTN_PROJ + norms + DENSE_MLP + 3 * active_layer}


def tiny_moe(*overrides):
    return compose_run("model=tiny_moe", f"model.seq_length={S}", *overrides)


def _routers(model):
    from depthmix.megatron_ext.moe import ExpertLoadRouter

    return [m for m in model.modules() if isinstance(m, ExpertLoadRouter)]


@pytest.mark.parametrize("shared", [0, 64], ids=["tiny_moe", "shared_expert"])
def test_flops_mfu_and_parameters_count_the_activated_experts(megatron_single, shared):
    from torch.utils.flop_counter import FlopCounterMode

    from depthmix.megatron_ext.config import to_transformer_config

    run = tiny_moe(f"model.moe.shared_expert_ffn_hidden_size={shared}")
    mixer, hand = mixer_of(run), hand_count(shared)
    f = acc.flops_per_token(run, mixer)
    assert {k: f[k] for k in ("linear", "moe", "attention", "head")} == \
        {k: hand[k] for k in ("linear", "moe", "attention", "head")}
    forward = hand["linear"] + hand["attention"] + hand["head"]
    assert f["train"] == 3 * forward
    assert acc.total_params(run, mixer) == hand["total"]
    assert acc.activated_params(run, mixer) == hand["activated"]

    torch.manual_seed(0)
    model = build_model(run)
    assert sum(p.numel() for p in model.parameters()) == hand["total"]
    ids = torch.randint(0, run.model.vocab_size, (2, S))
    with FlopCounterMode(display=False) as counter:  # CPU SDPA is invisible to it
        model(ids)
    assert counter.get_total_flops() == (hand["linear"] + hand["head"]) * 2 * S
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).sum().backward()
    assert counter.get_total_flops() == 3 * (hand["linear"] + hand["head"]) * 2 * S

    # the trainer's meter: MFU = activated training FLOPs x tokens/s / devices / peak
    run.train.peak_tflops = 1e-3
    meter = acc.ThroughputMeter.of(run, mixer, to_transformer_config(run), world_size=2,
                                   device_name=None)
    assert meter.train_flops_per_token == 3 * forward
    meter.add(0.5)
    tokens_per_s = run.train.global_batch_size * S / 0.5
    assert meter.read().mfu == pytest.approx(3 * forward * tokens_per_s / 2 / 1e9)


def test_dropped_assignments_are_the_only_flops_the_count_has_beyond_the_model(
        megatron_single):
    """With a capacity factor the experts run the kept assignments only: the counter sees
    the formula (k experts a token) less 2 x 3 h f_e per assignment the routers dropped."""
    from torch.utils.flop_counter import FlopCounterMode

    run = tiny_moe("model.moe.dropless=false", "model.moe.capacity_factor=0.5")
    f = acc.flops_per_token(run, mixer_of(run))
    torch.manual_seed(0)
    model = build_model(run)
    ids = torch.randint(0, run.model.vocab_size, (2, S))
    with FlopCounterMode(display=False) as counter:
        model(ids)
    taken = [r.take() for r in _routers(model)]
    dropped = sum(int(t[-1] - t[:-1].sum()) for t in taken)
    assert dropped > 0
    assert counter.get_total_flops() == (f["linear"] + f["head"]) * 2 * S - dropped * 2 * ROUTED


def _rank_params(run, model, tp: int, pp: int, ep: int):
    """The built (one-rank) model's parameters as one TP x EP rank of each pipeline stage
    holds them: the routed experts' (``MoELayer.experts``) split over ep and tp, other
    ``tensor_model_parallel`` ones over tp, the rest whole. ``(all, experts)``."""
    from depthmix.planning.pipeline import PipelineLayout

    layout = PipelineLayout(run.model.num_layers, pp, 1)
    stage = {i: layout.rank_of(c) for c in range(layout.num_chunks) for i in layout.layers(c)}
    total, experts = [0] * pp, [0] * pp
    for name, p in model.named_parameters():
        expert = ".mlp.experts." in name
        split = (tp * ep if expert else tp) if getattr(p, "tensor_model_parallel", False) else 1
        if name.startswith("decoder.layers."):
            r = stage[int(name.split(".")[2])]
        else:
            r = 0 if name.split(".")[0] == "embedding" else pp - 1
        total[r] += p.numel() // split
        experts[r] += p.numel() // split if expert else 0
    return total, experts


def test_parameters_per_stage_and_tp_x_ep_rank(megatron_single):
    """The memory model's parameters per TP x EP rank of each stage are the built model's,
    grouped as Megatron places them; the routed experts' optimizer state shards over the
    expert-data-parallel group (dp / ep ranks), the rest over dp."""
    run = tiny_moe("model.moe.shared_expert_ffn_hidden_size=64")
    model = build_model(run)
    for tp, pp, ep in ((1, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 4)):
        p = run.parallel
        p.tp, p.pp, p.ep, p.sequence_parallel = tp, pp, ep, tp > 1
        ranks = memory.estimate(run, mixer_of(run), world_size=tp * pp * 4)
        total, experts = _rank_params(run, model, tp, pp, ep)
        assert [r.params for r in ranks] == total, (tp, pp, ep)
        assert [r.expert_params for r in ranks] == experts, (tp, pp, ep)
    run.parallel.distributed_optimizer = True  # dp 4, ep 4: the experts' group is 1 rank
    (rank,) = memory.estimate(run, mixer_of(run), world_size=8)
    dense = rank.params - rank.expert_params
    assert rank.optimizer_bytes == 8 * dense / 4 + 8 * rank.expert_params / 1


MOE_PRESETS = {"tiny_moe": "vanilla", "kimi_moe_small": "attnres_block",
               "deepseek_moe_small": "mhc"}


def preset_run(preset: str):
    """An MoE preset with its mixer at 64 tokens, two micro-batches of two, fp32."""
    return compose_run(f"model={preset}", f"mixer={MOE_PRESETS[preset]}", "model.seq_length=64",
                       "train.micro_batch_size=2", "train.global_batch_size=4",
                       "train.precision=fp32")


@pytest.mark.parametrize("preset", list(MOE_PRESETS))
def test_memory_model_matches_a_step_on_one_rank(megatron_single, preset):
    run = preset_run(preset)
    measured = probe_one(run)
    (est,) = memory.estimate(run, mixer_of(run), world_size=1)
    assert measured["param_bytes"] == est.weight_bytes
    assert measured["grad_bytes"] == est.grad_bytes
    assert measured["optimizer_bytes"] == est.optimizer_bytes
    assert sum(est.saved_per_micro) == pytest.approx(measured["saved_per_micro"], rel=0.10)
    assert 0 < est.moe_activation_bytes < est.activation_bytes


def test_routing_bound():
    """Rows a rank's experts can receive per token: k at ep 1; dropless, every token's
    experts on one rank (at most E / ep of them); a capacity factor caps it."""
    e = Experts.of(compose_run("model=1p5b_moe"))  # 16 experts, top-4
    tokens = 4096
    assert [e.rows_bound(tokens, 1, False, ep) for ep in (1, 2, 8, 16)] == [4, 8, 16, 16]
    capped = Experts.of(compose_run("model=1p5b_moe", "model.moe.dropless=false",
                                    "model.moe.capacity_factor=1.25"))
    assert capped.rows_bound(tokens, 1, False, 8) == 16 * 1280 / tokens == 5.0
    # one micro-batch of 2048 tokens in flight, 48 MoE layers, 16 rows a token instead of 4
    run = compose_run("model=1p5b_moe", "train.micro_batch_size=1", "train.precision=bf16",
                      "parallel.ep=8")
    (rank,) = memory.estimate(run, get_mixer("vanilla"), world_size=8)
    assert rank.inflight_microbatches == 1
    assert rank.routing_bound_bytes == pytest.approx(48 * (16 - 4) * 2048 * e.row_bytes(1, 2))


# ---------------------------------------------------------------------------------------
# The planner and the dry run
# ---------------------------------------------------------------------------------------


def test_planner_searches_expert_parallelism_only_with_experts():
    cluster = plan.Cluster(gpus=8, micro_batch_sizes=(1,))
    moe = {(lay.dp, lay.ep) for lay in plan.candidates(compose_run("model=tiny_moe"), cluster)}
    assert {ep for dp, ep in moe if dp == 8} == {1, 2, 4}  # 4 experts
    assert {ep for dp, ep in moe if dp == 2} == {1, 2}
    dense = {lay.ep for lay in plan.candidates(compose_run("model=tiny"), cluster)}
    assert dense == {1}


def test_all_to_all_and_expert_gradients_in_the_step_time():
    """1p5b_moe on 16 GPUs of 8 a node, DP16 without overlap: the all-to-all is 4 per MoE
    layer and micro-batch (dispatch and combine, forward and backward), each sending
    (ep - 1) / ep of b s k h bf16 bytes, over NVLink while the EP group is inside a node;
    the routed experts' gradients all-reduce over dp / ep ranks."""
    run = compose_run("model=1p5b_moe", "train=paper", "train.precision=bf16",
                      "parallel.overlap_grad_reduce=false")
    cluster = plan.Cluster(gpus=16, nodes=2)
    kind = cluster.kind()
    m = run.model
    micro = 1024 // (2 * 16)
    sent = 2 * m.seq_length * 4 * m.hidden_size * 2
    seconds = {}
    for ep in (1, 4, 16):
        lay = plan.Layout(1, 1, None, 16, 2, "none", False, False, ep)
        seconds[ep] = plan.evaluate(run, get_mixer("vanilla"), lay, cluster).seconds
    assert seconds[1]["a2a"] == 0
    assert seconds[4]["a2a"] == pytest.approx(
        micro * 48 * 4 * sent * 3 / 4 / (kind.nvlink_gbs * 1e9))
    assert seconds[16]["a2a"] == pytest.approx(
        micro * 48 * 4 * sent * 15 / 16 / (kind.network_gbs * 1e9))
    experts = 48 * 16 * 3 * m.hidden_size * 1024
    dense = acc.total_params(run, get_mixer("vanilla")) - experts
    bw = kind.network_gbs * 1e9
    assert seconds[1]["dp"] == pytest.approx((dense + experts) * 8 * 15 / 16 / bw)
    assert seconds[4]["dp"] == pytest.approx((dense * 15 / 16 + experts / 4 * 3 / 4) * 8 / bw)
    assert seconds[16]["dp"] == pytest.approx(dense * 8 * 15 / 16 / bw)


def test_plan_of_an_moe_preset_prints_its_terms_and_composes():
    from depthmix.cli.plan import main as plan_main
    from depthmix.cli.train import dry_run

    out = io.StringIO()
    assert plan_main(["model=tiny_moe", "train.global_batch_size=64", "train.precision=bf16",
                      "cluster.gpus=8"], out=out) == 0
    text = out.getvalue()
    assert " a2a " in text.split("valid layouts")[1]
    assert "experts: 4 routed, top-2; FLOPs count the activated parameters" in text
    assert "experts: the chosen layout's MoE layers save" in text
    words = text.split("chosen:\n", 1)[1].split()
    assert words[0] == "depthmix-train" and any(w.startswith("parallel.ep=") for w in words)
    report = io.StringIO()
    assert dry_run(compose_run(*words[1:]), out=report) == 0


def test_dry_run_prints_moe_memory_per_rank():
    from depthmix.cli.train import dry_run

    run = compose_run("model=1p5b_moe", "train=paper", "train.precision=bf16", "parallel.pp=4")
    out = io.StringIO()
    assert dry_run(run, world_size=64, out=out) == 0
    text = out.getvalue()
    total, active = acc.total_params(run, get_mixer("vanilla")), \
        acc.activated_params(run, get_mixer("vanilla"))
    assert f"model parameters: 4.06B ({total:,}), 1.34B ({active:,}) activated per token" in text
    assert "(MoE layers 1.81B: router, top-4 experts)" in text
    section = text.split("# experts per rank: 48 MoE layers of 16 experts (top-4)")[1]
    rows = [line.split() for line in section.splitlines()[2:6]]
    ranks = memory.estimate(run, get_mixer("vanilla"), 64)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [r[1] for r in rows] == ["905.97M"] * 4  # 12 MoE layers of 16 x 3 h 1024 a stage
    assert [float(r[4]) for r in rows] == [round(x.moe_activation_bytes / 2**30, 2)
                                           for x in ranks]


def test_overheads_with_experts_are_the_mixers_own_and_say_what_the_share_is_of(capsys):
    """A depth mixer's costs do not change with experts; its share is of the activated
    vanilla forward, which the table's opening line states."""
    from depthmix.cli.overheads import main
    from depthmix.planning.overheads import overheads

    moe = compose_run("model=kimi_moe_small", "mixer=mhc", "parallel.pp=4")
    dense = compose_run("model=kimi_moe_small", "mixer=mhc", "parallel.pp=4",
                        "model.moe.num_experts=0")
    a, b = overheads(moe, get_mixer("mhc")), overheads(dense, get_mixer("mhc"))
    same = ("flops_per_token", "io_bytes_per_token", "state_bytes", "params", "pipeline_bytes")
    assert {k: getattr(a, k) for k in same} == {k: getattr(b, k) for k in same}
    f = acc.flops_per_token(moe, get_mixer("mhc"))
    assert a.flops_share == f["mixer"] / (f["forward"] - f["mixer"])
    assert main(["model=kimi_moe_small", "--mixers", "vanilla,mhc"]) == 0
    printed = capsys.readouterr().out
    assert "experts: 16 routed, top-4 a token; '% of model' is of the vanilla forward by " \
           "activated parameters" in printed
