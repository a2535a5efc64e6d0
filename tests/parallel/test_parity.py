"""Every mixer at every parallel layout reproduces the single-rank run (CPU, gloo, fp32).

Each layout trains all registered mixers for 3 steps in real processes (real Megatron
parallel state, real P2P; one group of processes per world size) from the same seed,
which gives the same initial weights at every layout: TP2 x PP2 with sequence parallelism
by default (tensor, sequence and pipeline parallelism at once), the other layouts in the
full lane. Compared with one rank: the 3 losses
(relative 1e-5) and the gradients after step 1, relative to the gradient norm: the whole
gradient and every parameter's error within 1e-5 of the global norm. (Not each tensor
relative to its own norm: a tensor whose gradient is a near-cancelling sum, e.g. DDL's
layer-0 read vector with norm 1e-5, already differs by 1e-4 between fp32 and fp64 on one
rank.)
"""


import pytest
import torch

from depthmix.testing import assert_same_training, run_layouts, variant_cases, variant_run

from layouts import full_except

pytestmark = pytest.mark.multiproc

# case id -> (mixer, Variant): each mixer's ``parity`` variants, options that make it send
# more than the bare minimum across stages (and ShortSWA, an option of every mixer).
CASES = {test_id: (mixer, variant) for test_id, mixer, variant in variant_cases("parity")}

# name: (world size, parallel options)
LAYOUTS = {
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2}),
    "pp2_vp2": (2, {"pp": 2, "vp": 2}),
    "dp2_distopt": (2, {"distributed_optimizer": True}),
    "tp2_pp2": (4, {"tp": 2, "pp": 2, "sequence_parallel": True}),
    "recompute": (1, {"recompute": "full"}),
}
MIXERS = list(CASES)
DEFAULT = {"tp2_pp2"}
"""The default lane's layout."""


def make_run(case: str, **parallel):
    run = variant_run(*CASES[case])
    run.train.micro_batch_size, run.train.global_batch_size = 2, 8  # 4 micro-batches at DP=1
    run.train.lr = 1e-2
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    return run


def _layouts_run_here(session) -> list:
    """The layouts this session's tests of this file use (all, or those ``-k`` selects)."""
    return [item.callspec.params["layout"] if hasattr(item, "callspec") else "pp2"
            for item in session.items if item.module.__name__ == __name__]


@pytest.fixture(scope="session")
def layout_results(request):
    """layout -> mixer -> result, with ``"single"`` the one-rank reference. The layouts of
    one world size train in one group of processes, Megatron's parallel state rebuilt
    between runs: three launches in all (1, 2 and 4 ranks)."""
    cache = {}
    layouts = {"single": (1, {}), **LAYOUTS}

    def get(layout):
        if layout not in cache:
            world = layouts[layout][0]
            wanted = dict.fromkeys(["single", layout, *_layouts_run_here(request.session)])
            group = [n for n in wanted if layouts[n][0] == world and n not in cache]
            runs = [make_run(m, **layouts[name][1]) for name in group for m in MIXERS]
            results = iter(run_layouts(runs, world_size=world, timeout=1200))
            for name in group:
                cache[name] = {m: next(results) for m in MIXERS}
        return cache[layout]

    return get


def assert_matches(result, ref, label):
    total = assert_same_training(result, ref, label, loss_rtol=1e-5, grad_rtol=1e-5)
    assert total <= 1e-5, f"{label}: gradient err {total:.2e}"
    for name, w_ref in ref["init_params"].items():
        assert torch.equal(result["init_params"][name], w_ref), \
            f"{label}: initial {name} differs across layouts"


@pytest.mark.parametrize("layout", full_except(LAYOUTS, DEFAULT))
@pytest.mark.parametrize("mixer", MIXERS)
def test_layout_matches_single_rank(mixer, layout, layout_results):
    """Losses and gradients of ``mixer`` at ``layout`` equal the single-rank run."""
    assert_matches(layout_results(layout)[mixer], layout_results("single")[mixer],
                   f"{mixer}@{layout}")


@pytest.mark.parametrize("layout", full_except(["pp2", "pp2_vp2", "tp2_pp2"], DEFAULT))
@pytest.mark.parametrize("mixer", MIXERS)
def test_bytes_sent_follow_the_plan(mixer, layout, layout_results):
    """Payload bytes each chunk packed = the transport's per-transition formula."""
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.mixers import mixer_of
    from depthmix.planning.pipeline import PipelineLayout, geometry_of

    world, parallel = LAYOUTS[layout]
    run = make_run(mixer, **parallel)
    config = to_transformer_config(run)
    p = run.parallel
    geo = geometry_of(mixer_of(run).plan, config,
                      PipelineLayout(config.num_layers, p.pp, p.vp or 1), p.tp)
    steps, micro = 3, run.train.micro_batch_size
    num_micro = run.train.global_batch_size // micro
    measured = layout_results(layout)[mixer]["bytes_sent"]
    for chunk in range(geo.layout.num_chunks - 1):
        expected = steps * num_micro * geo.payload_bytes(chunk + 1, micro, 4)
        assert measured[chunk] == expected, f"chunk {chunk}: {measured[chunk]} != {expected}"


@pytest.mark.full
def test_vanilla_bytes_closed_form(layout_results):
    """Vanilla sends exactly the hidden state: s * b * h * 4 bytes per micro-batch."""
    run = make_run("vanilla", pp=2)
    m, t = run.model, run.train
    per_micro = m.seq_length * t.micro_batch_size * m.hidden_size * 4
    assert layout_results("pp2")["vanilla"]["bytes_sent"][0] == 3 * 4 * per_micro
