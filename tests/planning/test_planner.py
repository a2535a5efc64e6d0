"""depthmix-plan: refuses a model that fits nowhere, picks what a hand calculation says is
fastest, and prints overrides that compose and pass the dry run."""

import io

import pytest

from depthmix.cli.plan import main as plan_main
from depthmix.cli.train import dry_run
from depthmix.config.load import compose_run
from depthmix.planning import flops as acc
from depthmix.planning import planner as plan
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
    DP2 with the distributed optimizer reduce-scatters 4-byte gradients and all-gathers
    2-byte bf16 parameters, (dp-1)/dp of each per GPU, over the network (cheaper than an
    all-reduce's 2 x 4 x (dp-1)/dp); PP2
    idles (pp-1)/m of the compute and sends each micro-batch's hidden state (b s h x 2
    bytes) forward and its gradient back over the network."""
    run = compose_run(*TINY)
    m, t = run.model, run.train
    kind = cluster.kind()
    compute = (acc.flops_per_token(run)["train"] * t.global_batch_size * m.seq_length
               / (2 * kind.peak_tflops * 1e12 * kind.mfu))
    dp_bytes = acc.total_params(run) * (4 + 2) * (1 / 2)
    dp2 = compute + dp_bytes / (kind.network_gbs * 1e9)
    micro = t.global_batch_size  # micro batch 1, one pipeline
    p2p = micro * 2 * (1 * m.seq_length * m.hidden_size * 2) / (kind.network_gbs * 1e9)
    pp2 = compute + compute * (2 - 1) / micro + p2p
    return dp2, pp2


@pytest.mark.parametrize("network_gbs", [1e6, 1e-3])
def test_picks_the_layout_a_hand_calculation_says_is_fastest(network_gbs):
    cluster = plan.Cluster(gpus=2, nodes=2, network_gbs=network_gbs, micro_batch_sizes=(1,))
    dp2, pp2 = _hand_times(cluster)
    fitting, _ = plan.plan(compose_run(*TINY), cluster)
    best = fitting[0]
    expected = "dp" if dp2 < pp2 else "pp"
    assert (best.layout.dp, best.layout.pp) == ((2, 1) if expected == "dp" else (1, 2))
    assert best.layout.recompute == "none"  # recomputation only adds time
    assert best.step_seconds == pytest.approx(min(dp2, pp2), rel=0.02)


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
