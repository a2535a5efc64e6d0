"""``mixer=moda`` with ``mixer.impl=triton`` (the split path: SDPA's CPU flash kernel and the
Triton depth kernel in Triton's interpreter on CPU; ``mixer.moda_kernel=fused`` in process)
trains like ``mixer.impl=torch``: 2 steps of the tiny GQA model (G = 2), losses within 1e-4
relative, at TP=1, TP=2 with sequence parallelism, PP=2 and with full activation
recomputation. One process group per world size: the runs of a group train one after
the other in the same ranks."""


import pytest
import torch

from depthmix.testing import assert_same_training, run_layouts, tiny_run

from layouts import PerWorld, layout_params

STEPS = 2  # the second step's forward runs the kernels on updated weights

LAYOUTS = {  # name: (world size, parallel options)
    "tp1": (1, {}),
    "recompute": (1, {"recompute": "full"}),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2}),
}


def make_run(impl: str, **parallel):
    # a window of 3 with both projection families: every kind of depth entry, D up to 3
    run = tiny_run("moda", impl=impl, depth_window=3, attn_kv_proj=True)
    run.train.micro_batch_size, run.train.global_batch_size = 2, 4  # 2 micro-batches
    run.train.lr = 1e-2
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    return run


@pytest.fixture(scope="module")
def results():
    """``results(world)``: {layout: {impl: losses}} for the layouts of that world size,
    trained in one process group on first use."""
    def train(world):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        runs = [make_run(impl, **LAYOUTS[n][1]) for n in names for impl in ("torch", "triton")]
        res = iter(run_layouts(runs, world_size=world, steps=STEPS, mode="losses"))
        return {n: {impl: next(res)["losses"] for impl in ("torch", "triton")} for n in names}

    return PerWorld(train)


@pytest.mark.slow
@pytest.mark.parametrize("layout", layout_params(LAYOUTS, __name__))
def test_triton_trains_like_torch(layout, results):
    by_impl = results(LAYOUTS[layout][0])[layout]
    torch_losses, triton_losses = by_impl["torch"], by_impl["triton"]
    assert len(triton_losses) == STEPS
    assert_same_training({"losses": triton_losses}, {"losses": torch_losses}, layout,
                         loss_rtol=1e-4)
    assert triton_losses[0] != triton_losses[-1]  # it trained


def test_impl_selects_the_kernel(megatron_single):
    """``mixer.impl`` (and ``mixer.moda_kernel``) pick the op once, at construction: every
    MoDA core attention of a ``triton`` model holds the split path (``moda_kernel=fused``:
    the fused kernel), of a ``torch`` model the reference."""
    from depthmix.kernels.moda_attention import (
        moda_attention_fused,
        moda_attention_reference,
        moda_attention_triton,
    )
    from depthmix.mixers.moda.model import MoDACoreAttention
    from depthmix.testing import build_model

    for options, expected in (({"impl": "triton"}, moda_attention_triton),
                              ({"impl": "triton", "moda_kernel": "fused"}, moda_attention_fused),
                              ({"impl": "torch", "moda_kernel": "fused"},
                               moda_attention_reference)):
        model = build_model(tiny_run("moda", **options))
        cores = [m for m in model.modules() if isinstance(m, MoDACoreAttention)]
        assert len(cores) == 4 and all(c.moda_attention is expected for c in cores), options


@pytest.mark.parametrize("kernel", ["split", "fused"])
def test_triton_model_matches_torch_model_in_process(megatron_single, kernel):
    """Same weights, one forward/backward of the whole model: logits and every parameter
    gradient of impl=triton (either Triton path) match impl=torch (fp32)."""
    from depthmix.testing import build_model

    torch.manual_seed(0)
    ref = build_model(tiny_run("moda", impl="torch", depth_window=3))
    tri = build_model(tiny_run("moda", impl="triton", depth_window=3, moda_kernel=kernel))
    tri.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    out_ref, out_tri = ref(ids), tri(ids)
    torch.testing.assert_close(out_tri, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.float().square().mean().backward()
    out_tri.float().square().mean().backward()
    for (name, p_ref), (_, p_tri) in zip(ref.named_parameters(), tri.named_parameters()):
        torch.testing.assert_close(p_tri.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=name)
