"""``model.moe``, ``parallel.ep`` and ``parallel.expert_tp``: an impossible expert
configuration stops at start-up with one line naming the option (exit status 2, nothing
built), the expert layouts Megatron-Core builds pass; a dense preset takes experts only with
a number of them."""

from __future__ import annotations

import sys

import pytest

from depthmix.config.load import compose_run
from depthmix.config.schema import ConfigError
from depthmix.pretrain.preflight import preflight

SP = ["parallel=tp2", "parallel.sequence_parallel=true"]
BAD = [
    # (overrides, world size, what the message names)
    (["model=tiny_moe", "model.moe.num_experts=3", "parallel.ep=2"], 2,
     "model.moe.num_experts=3 is not divisible by parallel.ep=2"),
    (["model=tiny_moe", "model.moe.top_k=5"], 1, "model.moe.top_k=5"),
    # Megatron's expert grid: world = pp x expert_tp x ep x expert data parallel
    (["model=tiny_moe", "parallel.ep=2"], 1,
     "parallel.ep=2 does not fit world size 1: parallel.ep * parallel.expert_tp * parallel.pp "
     "= 2 * 1 * 1 must divide it"),
    (["model=tiny_moe", "parallel.ep=2", *SP], 2, "= 2 * 2 * 1 must divide it"),
    (["model=tiny_moe", "parallel.ep=2", "parallel=pp2"], 2, "= 2 * 1 * 2 must divide it"),
    (["model=tiny_moe", "parallel.expert_tp=3", *SP], 2,
     "parallel.expert_tp=3 must be 1 or parallel.tp=2"),
    (["parallel.expert_tp=1"], 1, "parallel.expert_tp=1 needs experts"),
    (["model=tiny_moe", "model.moe.capacity_factor=1.5"], 1,
     "model.moe.capacity_factor=1.5 needs model.moe.dropless=false"),
    (["model=tiny_moe", "model.moe.dropless=false"], 1, "model.moe.capacity_factor"),
    (["model=tiny", "model.moe.top_k=3"], 1,
     "model.moe.top_k=3 is set but model=tiny has no experts"),
    (["parallel.ep=2"], 2, "parallel.ep=2 needs experts"),
    (["model=tiny_moe", "model.moe.expert_bias=true"], 1, "model.moe.score_function=sigmoid"),
    (["model=tiny_moe", "model.moe.top_k=1"], 1, "model.moe.normalize_top_k=false"),
    (["model=tiny_moe", "model.moe.score_function=sigmoid", "model.moe.normalize_top_k=false"],
     1, "model.moe.normalize_top_k=false needs"),
    (["model=tiny_moe", "parallel=tp2", "parallel.sequence_parallel=false"], 2,
     "parallel.sequence_parallel=true"),
    (["model=tiny_moe", "model.moe.first_dense_layers=4"], 1, "model.moe.first_dense_layers=4"),
    (["model=tiny_moe", "model.moe.score_function=sigmod"], 1, "did you mean 'sigmoid'"),
    (["model=tiny_moe", "model.moe.aux_loss_scope=global"], 1, "model.moe.aux_loss_scope"),
    (["model=tiny_moe", "model.moe.z_loss_coeff=-1"], 1, "model.moe.z_loss_coeff=-1"),
    (["model=tiny_moe", "train.compile=true"], 1, "train.compile=true with experts"),
    (["model=tiny_moe", "train.cuda_graphs=true"], 1, "train.cuda_graphs=true with experts"),
    (["model=tiny_moe", "model.moe.experts_impl=grouped_mm"], 1, "did you mean 'grouped'"),
    (["model=tiny_moe", "model.moe.experts_impl=grouped", "model.moe.ffn_hidden_size=170"], 1,
     "model.moe.experts_impl=grouped: model.hidden_size=128 and the expert width per rank "
     "(model.moe.ffn_hidden_size=170 / parallel.tp=1) must be multiples of 4"),
    (["model=tiny_moe", "model.moe.experts_impl=grouped", "model.moe.ffn_hidden_size=168",
      "train.precision=bf16", *SP], 2,
     "(model.moe.ffn_hidden_size=168 / parallel.tp=2) must be multiples of 8"),
    (["model=tiny", "model.moe.experts_impl=grouped"], 1,
     "model.moe.experts_impl=grouped is set but model=tiny has no experts"),
]


@pytest.mark.parametrize("overrides, world, message", BAD,
                         ids=[" ".join(case[0]) + f"-w{case[1]}" for case in BAD])
def test_bad_expert_option_names_it(overrides, world, message):
    with pytest.raises(ConfigError) as info:
        preflight(compose_run(*overrides), world_size=world)
    assert message in str(info.value)


@pytest.mark.parametrize("preset", ["tiny_moe", "kimi_moe_small", "deepseek_moe_small",
                                    "1p5b_moe"])
def test_moe_presets_are_valid(preset):
    run = compose_run(f"model={preset}")
    preflight(run, world_size=1)
    assert run.model.experts is not None


def test_experts_impl_auto_is_resolved_once_and_logged(caplog):
    """``auto`` is grouped on CUDA only, where the rows are aligned; the choice is logged and
    an explicit value is kept (grouped runs on the CPU too: torch 2.9+ has a CPU kernel)."""
    import logging

    import torch

    with caplog.at_level(logging.INFO, logger="depthmix"):
        run = compose_run("model=tiny_moe")
    want = "grouped" if torch.cuda.is_available() else "sequential"
    assert run.model.moe.experts_impl == want
    assert [r.getMessage() for r in caplog.records if "experts_impl" in r.getMessage()] == [
        f"model.moe.experts_impl=auto -> {want} ("
        + ("CUDA: torch._grouped_mm, a loop of GEMMs for train.precision=fp32 (its fused "
           "kernel takes bf16 on sm90/sm100))" if want == "grouped" else "no CUDA device)")]
    assert compose_run("model=tiny_moe", "model.moe.experts_impl=grouped").model.moe \
        .experts_impl == "grouped"
    misaligned = compose_run("model=tiny_moe", "model.moe.ffn_hidden_size=170")
    assert misaligned.model.moe.experts_impl == "sequential"
    assert compose_run("model=tiny").model.moe.experts_impl == "auto"  # dense: left alone


@pytest.mark.parametrize("overrides, world", [
    (["parallel.ep=2"], 2),  # EP over the data-parallel ranks
    (["parallel.ep=4", "parallel.distributed_optimizer=true", "train.micro_batch_size=2"],
     8),  # and expert DP 2
    ([*SP, "parallel.ep=2", "parallel.expert_tp=1"], 2),  # EP over the TP ranks
    ([*SP, "parallel.ep=2"], 4),  # expert TP 2 x EP 2, DP 2
    ([*SP, "parallel.expert_tp=1"], 2),  # experts whole on each TP rank, expert DP 2
    (["parallel=pp2_vp2", "parallel.ep=2", "train.micro_batch_size=2"], 4),
])
def test_expert_layouts_megatron_builds_pass(overrides, world):
    preflight(compose_run("model=tiny_moe", *overrides), world_size=world)


def test_a_dense_preset_takes_experts_by_their_number():
    assert compose_run("model=tiny").model.experts is None
    assert compose_run("model=tiny_moe", "model.moe=null").model.experts is None
    run = compose_run("model=tiny", "model.moe.num_experts=8", "model.moe.top_k=2")
    preflight(run, world_size=1)
    assert (run.model.experts.num_experts, run.model.experts.top_k) == (8, 2)


@pytest.mark.parametrize("overrides, message", [
    # at its default value: only the command line shows it was given
    (["model=tiny", "model.moe.top_k=2"], "model.moe.top_k=2 is set but model=tiny has no"),
    (["model=tiny_moe", "model.moe.topk=2"], "did you mean 'model.moe.top_k'"),
])
def test_cli_exits_2_with_one_line_before_building(monkeypatch, tmp_path, capsys, overrides,
                                                   message):
    from depthmix.cli.train import main
    from depthmix.pretrain import trainer

    def forbidden(*args, **kwargs):
        raise AssertionError("a bad option must be refused before anything is built")

    monkeypatch.setattr(trainer, "init_distributed", forbidden)
    monkeypatch.setattr(trainer, "build_model", forbidden)
    monkeypatch.setenv("DEPTHMIX_RUN_KEY", "test")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["depthmix-train", "logger=none", *overrides])
    try:
        status = main()
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err


def _megatron_builds(world: int, tp: int, pp: int, ep: int, etp: int) -> bool:
    """Whether Megatron-Core's ``initialize_model_parallel`` (0.16) takes this layout: its
    world-size checks, then its rank generators (dense tp-cp-ep-dp-pp and experts' own grid)
    with the same pipeline groups."""
    from megatron.core.parallel_state import RankGenerator

    if world % (tp * pp) or world % (etp * ep * pp):
        return False
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=order)
    experts = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1,
                            order=order)
    return dense.get_ranks("pp") == experts.get_ranks("pp")


def test_expert_world_size_checks_agree_with_megatron():
    """Every (world, tp, pp, ep, expert_tp) up to 8 ranks: start-up refuses exactly what
    Megatron's process-group set-up cannot build (the batch is sized to fit every DP)."""
    from depthmix.config.validate import validate_layout

    run = compose_run("model=tiny_moe", "train.micro_batch_size=1",
                      "train.global_batch_size=840")
    layout = run.parallel
    for world in range(1, 9):
        for tp, pp, ep in [(t, p, e) for t in (1, 2, 4) for p in (1, 2) for e in (1, 2, 4)]:
            for etp in sorted({1, tp}):
                layout.tp, layout.pp, layout.ep, layout.expert_tp = tp, pp, ep, etp
                layout.sequence_parallel = tp > 1
                try:
                    validate_layout(run, world)
                    ours = True
                except ConfigError:
                    ours = False
                assert ours == _megatron_builds(world, tp, pp, ep, etp), \
                    (world, tp, pp, ep, etp)
