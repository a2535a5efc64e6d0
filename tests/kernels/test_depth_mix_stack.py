"""Depth-Attention with ``mixer.impl=triton`` trains like ``impl=torch`` at every layout.

The tiny model (4 layers, GQA G=2, fp32) with ``depth_attn`` at stride 1 (every earlier
layer is a source: S = 1..3) and stride 2 (S <= 2, and layers without sources), 2 steps
each; the kernels run in Triton's interpreter on CPU (spawned ranks inherit
``TRITON_INTERPRET=1``). Per world size one group of processes trains all its runs. Losses
must agree within 1e-4 relative at TP=1, TP=2 with sequence parallelism, PP=2 and with
full activation recomputation, and gradients after step 1 within 1e-4 of the gradient norm.
"""


import pytest

from depthmix.testing import assert_same_training, run_layouts, tiny_run

from layouts import PerWorld, layout_params

pytestmark = pytest.mark.slow
STEPS = 2  # the second step's forward runs the kernels on updated weights

RUNS = [(impl, stride) for stride in (1, 2) for impl in ("torch", "triton")]
# layout: (world size, [parallel options per group of runs]); TP=1 and recompute share a group
LAYOUTS = {
    "tp1+recompute": (1, [{}, {"recompute": "full"}]),
    "tp2_sp": (2, [{"tp": 2, "sequence_parallel": True}]),
    "pp2": (2, [{"pp": 2}]),
}


def make_run(impl: str, stride: int, **parallel):
    run = tiny_run("depth_attn", stride=stride)
    run.mixer.impl = impl
    run.train.micro_batch_size, run.train.global_batch_size = 2, 4
    run.train.lr = 1e-2
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    return run


def _cases(layout) -> list:
    return [(str(parallel), impl, stride) for parallel in LAYOUTS[layout][1]
            for impl, stride in RUNS]


@pytest.fixture(scope="module")
def results():
    """``results(world)``: {layout: {(parallel, impl, stride): result}} for the layouts of
    that world size, trained in one process group on first use."""
    def train(world):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        runs = [make_run(impl, stride, **parallel) for n in names
                for parallel in LAYOUTS[n][1] for impl, stride in RUNS]
        res = iter(run_layouts(runs, world_size=world, steps=STEPS))
        return {n: {case: next(res) for case in _cases(n)} for n in names}

    return PerWorld(train)


@pytest.mark.parametrize("layout", layout_params(LAYOUTS, __name__))
def test_triton_trains_like_torch(layout, results):
    by_case = results(LAYOUTS[layout][0])[layout]
    for parallel in LAYOUTS[layout][1]:
        for stride in (1, 2):
            ref = by_case[(str(parallel), "torch", stride)]
            ours = by_case[(str(parallel), "triton", stride)]
            assert_same_training(ours, ref, f"{layout} {parallel} stride={stride}",
                                 loss_rtol=1e-4, grad_rtol=1e-4)
