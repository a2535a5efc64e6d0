"""The memory model (depthmix.planning.memory) against what real training steps hold, per
rank: bytes saved for backward per micro-batch within 10%, parameter, gradient and
optimizer-state bytes exact.

One launch of two gloo ranks measures every case the session runs: by default each mixer
at one layout, in rotation over DP2 + distributed optimizer, TP2 + sequence parallelism,
PP2, PP2 x VP2 and PP2 with full recomputation (every layout sees at least one depth-state
mixer); the full lane runs every other mixer at every layout (about 4x longer).

The MoE presets with their mixers (the experts' saved tensors: test_moe_accounting.py at
one rank) likewise: each at one layout by default (TP2 + SP, where the experts gather their
routed rows over TP; DP2 + distributed optimizer; PP2), every layout in the full lane, and
EP2 (with DP2 and the distributed optimizer: the experts' state over the
expert-data-parallel group).
"""

import pytest

from depthmix.config.load import compose_run
from depthmix.config.schema import ConfigError
from depthmix.config.validate import validate
from depthmix.mixers import available, mixer_of
from depthmix.planning import memory
from depthmix.testing import spawn, tiny_run

from layouts import full_except
from memory_probe import probe_runs

pytestmark = pytest.mark.multiproc

MIXERS = available()  # each at its defaults
LAYOUTS = {
    "dp2_distopt": {"distributed_optimizer": True},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
    "pp2_vp2": {"pp": 2, "vp": 2},
    "pp2_recompute": {"pp": 2, "recompute": "full"},
}
ROTATION = {m: list(LAYOUTS)[i % len(LAYOUTS)] for i, m in enumerate(MIXERS)}
"""The default lane's case of each mixer."""


MOE_PRESETS = {"tiny_moe": "vanilla", "kimi_moe_small": "attnres_block",
               "deepseek_moe_small": "mhc"}
MOE_LAYOUTS = {**{k: LAYOUTS[k] for k in ("tp2_sp", "dp2_distopt", "pp2", "pp2_recompute")},
               "ep2_distopt": {"ep": 2, "distributed_optimizer": True}}
MOE_ROTATION = {("tiny_moe", "tp2_sp"), ("kimi_moe_small", "dp2_distopt"),
                ("deepseek_moe_small", "pp2")}


def _cases():
    return [(m, lay) for lay in LAYOUTS for m in MIXERS]  # one layout at a time


def _moe_cases():
    return [(preset, lay) for lay in MOE_LAYOUTS for preset in MOE_PRESETS]


def _run(name, layout):
    """``name``: a mixer over the tiny test model, or an MoE preset with its mixer (64
    tokens)."""
    if name in MOE_PRESETS:
        run = compose_run(f"model={name}", f"mixer={MOE_PRESETS[name]}", "model.seq_length=64",
                          "train.precision=fp32")
        settings = MOE_LAYOUTS[layout]
    else:
        run, settings = tiny_run(name), LAYOUTS[layout]
    run.train.micro_batch_size, run.train.global_batch_size = 2, 4
    for k, v in settings.items():
        setattr(run.parallel, k, v)
    return run


def _refused(run):
    """The option checks' message when ``run`` cannot start on two ranks, else None."""
    try:
        validate(run, 2)
    except ConfigError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def measured(request):
    """One launch measures every case this session runs (all, or those ``-k`` selects) that
    the option checks accept."""
    cases = [item.callspec.params["case"] for item in request.session.items
             if item.originalname == "test_memory_model_matches_measurement"
             and item.module is request.module]
    cases = [c for c in cases if not _refused(_run(*c))]
    runs = [_run(*c) for c in cases]
    return dict(zip(cases, spawn(probe_runs, 2, (runs,), timeout=900)[0])) if runs else {}


@pytest.mark.parametrize("case", full_except(_cases(), ROTATION.items(),
                                             ids=lambda c: f"{c[0]}-{c[1]}")
                         + full_except(_moe_cases(), MOE_ROTATION,
                                       ids=lambda c: f"{c[0]}-{c[1]}"))
def test_memory_model_matches_measurement(measured, case):
    run = _run(*case)
    refused = _refused(run)
    if refused:
        pytest.skip(f"not accepted yet: {refused}")
    model = memory.estimate(run, mixer_of(run), world_size=2)
    distopt = run.parallel.distributed_optimizer
    for rank in measured[case]:
        est = model[rank["pp_rank"]]
        assert rank["param_bytes"] == est.weight_bytes, case
        assert rank["grad_bytes"] == est.grad_bytes, case
        if not distopt:
            assert rank["optimizer_bytes"] == est.optimizer_bytes, case
        predicted = sum(est.saved_per_micro)
        assert predicted == pytest.approx(rank["saved_per_micro"], rel=0.10), (case, rank)
    if distopt:  # DP2, one stage: the two shards add up to the whole state exactly
        shards = [r["optimizer_bytes"] for r in measured[case]]
        assert sum(shards) == 2 * model[0].optimizer_bytes, case
        assert max(shards) == pytest.approx(model[0].optimizer_bytes, rel=0.01), case
