"""The fused ``attnres`` kernel inside the training stack: Full and Block AttnRes with
``mixer.impl=triton`` (Triton's interpreter on CPU) train the tiny model 2 steps with the
losses (1e-4 relative) and step-1 gradients (1e-4 of the gradient norm) of
``mixer.impl=torch`` at TP=1, TP=2 with sequence parallelism, PP=2 and with full
activation recomputation. One process group per world size holds all of its runs."""


import pytest

from depthmix.kernels.attnres import attnres_reference, attnres_triton
from depthmix.kernels.dispatch import resolve_impl
from depthmix.testing import assert_same_training, build_model, run_layouts, tiny_run

from layouts import PerWorld, layout_params

STEPS = 2  # the second step's forward runs the kernels on updated weights

MIXERS = {"full": ("attnres_full", {}), "block": ("attnres_block", {"block_size": 2})}
# layout: (world size, parallel options)
LAYOUTS = {
    "tp1": (1, {}),
    "recompute": (1, {"recompute": "full"}),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2}),
}
RUNS = [(mixer, layout, impl) for layout in LAYOUTS for mixer in MIXERS
        for impl in ("torch", "triton")]


def make_run(mixer, layout, impl):
    name, options = MIXERS[mixer]
    run = tiny_run(name, **options)
    run.mixer.impl, _ = resolve_impl(impl)
    run.train.micro_batch_size, run.train.global_batch_size = 2, 4  # 2 micro-batches
    run.train.lr = 1e-2
    for key, value in LAYOUTS[layout][1].items():
        setattr(run.parallel, key, value)
    return run


@pytest.fixture(scope="module")
def results():
    """``results(world)``: {run key: result} for every run of that world size, trained in
    one process group on first use."""
    def train(world):
        keys = [k for k in RUNS if LAYOUTS[k[1]][0] == world]
        return dict(zip(keys, run_layouts([make_run(*k) for k in keys], world_size=world,
                                          steps=STEPS)))

    return PerWorld(train)


@pytest.mark.slow
@pytest.mark.parametrize("layout", layout_params(LAYOUTS, __name__))
@pytest.mark.parametrize("mixer", list(MIXERS))
def test_triton_trains_like_torch(mixer, layout, results):
    runs = results(LAYOUTS[layout][0])
    ours, ref = runs[(mixer, layout, "triton")], runs[(mixer, layout, "torch")]
    assert len(ours["losses"]) == STEPS
    assert_same_training(ours, ref, f"{mixer} {layout}", loss_rtol=1e-4, grad_rtol=1e-4)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_mixer_uses_the_resolved_impl(impl, megatron_single):
    model = build_model(make_run("full", "tp1", impl))
    ops = {m.attnres for m in model.modules() if hasattr(m, "attnres")}
    assert ops == {attnres_triton if impl == "triton" else attnres_reference}
