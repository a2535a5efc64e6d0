"""depthmix-plan: refuses a model that fits nowhere, picks what a hand calculation says is
fastest, and prints overrides that compose and pass the dry run."""

import io

import pytest

from depthmix.cli.plan import main as plan_main
from depthmix.cli.train import dry_run
from depthmix.config.load import compose_run
from depthmix.mixers import mixer_of
from depthmix.planning import flops as acc
from depthmix.planning import planner as plan
from depthmix.planning import step_time
from depthmix.runtime import exit_codes

TINY = ["model=tiny", "train.global_batch_size=8", "train.precision=bf16"]


def test_refuses_a_model_that_fits_nowhere_naming_the_shortfall(capsys):
    status = plan_main(["model=3b", "train=paper", "cluster.gpus=2", "cluster.memory_gib=16"],
                       out=io.StringIO())
    err = capsys.readouterr().err
    assert status == exit_codes.CONFIG_ERROR
    assert "fits on no layout of 2 x H100" in err
    assert "weights+grads+optimizer" in err and "short by" in err


def _hand_times(cluster: plan.Cluster):
    """Step seconds of pure DP2 and of PP2 (one GPU a node: no TP), from first principles:
    compute at the MFU of large layers times the GEMM efficiency w / (w + w_half) of a
    micro-batch (w = b s h h) plus a fixed cost per micro-batch and stage; DP2 with the
    distributed optimizer reduce-scatters 4-byte gradients and all-gathers 2-byte bf16
    parameters, (dp-1)/dp of each per GPU, over the network (cheaper than an all-reduce's
    2 x 4 x (dp-1)/dp); PP2 idles (pp-1)/m of the compute and stage costs and sends each
    micro-batch's hidden state (b s h x 2 bytes) forward and its gradient back over the
    network."""
    run = compose_run(*TINY)
    m, t = run.model, run.train
    kind = cluster.kind()
    c = step_time.constants(kind.name)  # the defaults, or the measured runs' fit
    w = 1 * m.seq_length * m.hidden_size * m.hidden_size
    eta = w / (w + c.gemm_half_work)
    compute = (acc.flops_per_token(run, mixer_of(run))["train"] * t.global_batch_size
               * m.seq_length / (2 * kind.peak_tflops * 1e12 * kind.mfu * eta))
    dp_bytes = acc.total_params(run, mixer_of(run)) * (4 + 2) * (1 / 2)
    dp2 = compute + (t.global_batch_size // 2) * c.stage_seconds \
        + dp_bytes / (kind.network_gbs * 1e9)
    micro = t.global_batch_size  # micro batch 1, one pipeline
    p2p = micro * 2 * (1 * m.seq_length * m.hidden_size * 2) / (kind.network_gbs * 1e9)
    stage = micro * c.stage_seconds
    pp2 = compute + stage + (compute + stage) * (2 - 1) / micro + p2p
    return dp2, pp2


@pytest.mark.parametrize("network_gbs", [1e6, 1e-3])
def test_picks_the_layout_a_hand_calculation_says_is_fastest(network_gbs):
    cluster = plan.Cluster(gpus=2, nodes=2, network_gbs=network_gbs, micro_batch_sizes=(1,))
    dp2, pp2 = _hand_times(cluster)
    run = compose_run(*TINY)
    fitting, _ = plan.plan(run, mixer_of(run), cluster)
    best = fitting[0]
    expected = "dp" if dp2 < pp2 else "pp"
    assert (best.layout.dp, best.layout.pp) == ((2, 1) if expected == "dp" else (1, 2))
    assert best.layout.recompute == "none"  # recomputation only adds time
    assert best.step_seconds == pytest.approx(min(dp2, pp2), rel=0.02)


def test_larger_micro_batches_run_closer_to_the_large_gemm_mfu():
    """The same layout at micro-batch 1 and 4: compute scales with 1 / eta, and the fixed
    per-micro-batch cost with the number of micro-batches."""
    cluster = plan.Cluster(gpus=1, micro_batch_sizes=(1, 4))
    run = compose_run(*TINY)
    _, everyone = plan.plan(run, mixer_of(run), cluster)
    by_mb = {c.layout.micro_batch: c for c in everyone if c.layout.recompute == "none"}
    w = run.model.seq_length * run.model.hidden_size ** 2
    half = step_time.constants(cluster.kind().name).gemm_half_work
    eta = {b: b * w / (b * w + half) for b in (1, 4)}
    assert by_mb[1].seconds["compute"] / by_mb[4].seconds["compute"] == \
        pytest.approx(eta[4] / eta[1], rel=1e-6)
    assert by_mb[1].seconds["stage"] == pytest.approx(4 * by_mb[4].seconds["stage"])
    assert by_mb[1].step_seconds > by_mb[4].step_seconds


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_leaves_the_last_bucket_and_what_backward_cannot_hide(overlap, monkeypatch):
    """DP2 over two nodes, gradients all-reduced (no distributed optimizer): without
    overlap the whole all-reduce is exposed; with it, what exceeds the last micro-batch's
    backward, but never less than one bucket."""
    monkeypatch.setattr(step_time, "BUCKET_PARAMS", 10_000)
    monkeypatch.setattr(step_time, "BUCKET_PARAMS_PER_DP", 1)
    run = compose_run(*TINY, f"parallel.overlap_grad_reduce={str(overlap).lower()}")
    for network_gbs in (1e-3, 1e6):  # communication far slower / far faster than compute
        cluster = plan.Cluster(gpus=2, nodes=2, network_gbs=network_gbs, micro_batch_sizes=(1,))
        _, everyone = plan.plan(run, mixer_of(run), cluster)
        dp2 = next(c for c in everyone if c.layout.dp == 2 and c.layout.recompute == "none"
                   and not c.layout.distributed_optimizer)
        params = acc.total_params(run, mixer_of(run))
        bw = network_gbs * 1e9
        reduce = params * 2 * 4 * (1 / 2) / bw
        backward = dp2.seconds["compute"] * 2 / 3 / (run.train.global_batch_size // 2)
        bucket = 10_000 * 2 * 4 * (1 / 2) / bw
        expected = max(bucket, reduce - backward) if overlap else reduce
        assert dp2.seconds["dp"] == pytest.approx(expected, rel=1e-6)
        if overlap and network_gbs > 1:
            assert dp2.seconds["dp"] < reduce  # hidden behind backward


def test_printed_overrides_compose_and_pass_the_dry_run():
    out = io.StringIO()
    assert plan_main([*TINY, "mixer=moda", "cluster.gpus=8"], out=out) == 0
    text = out.getvalue()
    line = text.split("chosen:\n", 1)[1].strip()
    words = line.split()
    assert words[0] == "depthmix-train" and "parallel.world_size=8" in words
    run = compose_run(*words[1:])
    assert run.parallel.world_size == 8
    report = io.StringIO()
    assert dry_run(run, out=report) == 0
    assert "dry run OK for world size 8" in report.getvalue()
