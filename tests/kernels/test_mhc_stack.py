"""mixer=mhc with the fused Triton kernels (``mixer.impl=triton``, the interpreter on CPU)
trains like the PyTorch path (``impl=torch``) inside the full stack: 2 steps at TP=1,
TP=2 with sequence parallelism, PP=2, and with full activation recomputation; losses within
1e-4 relative and the step-1 gradients within 1e-5 of the gradient norm (fp32, gloo, one
process group per world size; spawned ranks inherit TRITON_INTERPRET=1 from conftest)."""

import math

import pytest
import torch

from depthmix.testing import assert_same_training, run_layouts, tiny_run

from layouts import PerWorld, layout_params

pytestmark = pytest.mark.slow
STEPS = 2  # the second step's forward runs the kernels on updated weights

# name: (world size, parallel options)
LAYOUTS = {
    "tp1": (1, {}),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2}),
}


def make_run(impl, **parallel):
    # 4 streams; 5 Sinkhorn iterations keep the interpreter's backward short
    run = tiny_run("mhc", streams=4, sinkhorn_iters=5, impl=impl)
    run.train.micro_batch_size, run.train.global_batch_size = 2, 4  # 2 micro-batches
    run.train.lr = 1e-2
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    return run


def _runs(layout) -> list:
    """torch, triton (and at TP1 triton with full recomputation)."""
    parallel = LAYOUTS[layout][1]
    runs = [make_run("torch", **parallel), make_run("triton", **parallel)]
    return runs + [make_run("triton", recompute="full")] if layout == "tp1" else runs


@pytest.fixture(scope="module")
def results():
    """``results(world)``: {layout: [results of its runs]} for the layouts of that world
    size, trained in one process group on first use."""
    def train(world):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        res = iter(run_layouts([r for n in names for r in _runs(n)], world_size=world,
                               steps=STEPS))
        return {n: [next(res) for _ in _runs(n)] for n in names}

    return PerWorld(train)


@pytest.mark.parametrize("layout", layout_params(LAYOUTS, __name__))
def test_triton_trains_like_torch(layout, results):
    runs = results(LAYOUTS[layout][0])[layout]
    ref, ours = runs[0], runs[1]
    assert all(math.isfinite(x) for x in ref["losses"]) and len(ref["losses"]) == STEPS
    assert ref["losses"][0] != ref["losses"][-1]  # it trains
    assert_same_training(ours, ref, f"triton@{layout}", loss_rtol=1e-4, grad_rtol=1e-5)
    if layout == "tp1":
        recomputed = runs[2]
        assert_same_training(recomputed, ref, "triton+recompute@tp1", loss_rtol=1e-4,
                             grad_rtol=1e-5)
        for name, g in ours["grads"].items():  # recompute: identical gradients
            assert torch.equal(recomputed["grads"][name], g), name
