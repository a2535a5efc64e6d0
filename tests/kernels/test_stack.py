"""Every mixer's Triton kernels inside the training stack: ``mixer.impl=triton`` (Triton's
interpreter on CPU; spawned ranks inherit ``TRITON_INTERPRET=1``) trains the tiny model 2
steps with the losses (1e-4 relative) and step-1 gradients (1e-4 of the gradient norm) of
``mixer.impl=torch``, for each mixer's ``kernels`` variant (``Mixer.variants``: every mixer
with kernels, from the registry). At TP=1 by default (one micro-batch a step); with full
activation recomputation, TP=2 with sequence parallelism and PP=2 (two micro-batches a
step) in the full lane. One process group per world size
holds all of its runs. Also, in this process: a model holds the kernel its ``mixer.impl``
resolved to, and MoDA's two Triton paths give the torch model's logits and gradients. On
a GPU (``gpu``): the compiled kernels in bf16 at the 1.5B widths give the torch losses."""

import pytest
import torch

from depthmix.testing import assert_same_training, run_layouts, variant_cases, variant_run

from layouts import PerWorld, layout_params

STEPS = 2  # the second step's forward runs the kernels on updated weights

CASES = {test_id: (mixer, variant) for test_id, mixer, variant in variant_cases("kernels")}
# layout: (world size, parallel options, micro-batches a step); the first is the default
# lane's (one micro-batch: what the kernels see is the same, at half the interpreter's time)
LAYOUTS = {
    "tp1": (1, {}, 1),
    "recompute": (1, {"recompute": "full"}, 2),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}, 2),
    "pp2": (2, {"pp": 2}, 2),
}
GRAD_RTOL = 1e-4


def make_run(case: str, layout: str, impl: str):
    run = variant_run(*CASES[case])
    run.mixer.impl = impl
    run.train.micro_batch_size = 2
    run.train.global_batch_size = 2 * LAYOUTS[layout][2]
    run.train.lr = 1e-2
    for key, value in LAYOUTS[layout][1].items():
        setattr(run.parallel, key, value)
    return run


def _layouts_run_here(session) -> set:
    """The layouts this session's stack tests use (the default lane's, ``-m full``'s, or
    those ``-k`` selects): a world size's group trains only those."""
    return {item.callspec.params["layout"] for item in session.items
            if item.module.__name__ == __name__
            and item.originalname == "test_triton_trains_like_torch"}


@pytest.fixture(scope="module")
def results(request):
    """``results(world)``: {(case, layout, impl): result} for every run of that world size,
    trained in one process group on first use."""
    wanted = _layouts_run_here(request.session)

    def train(world):
        keys = [(case, layout, impl) for layout, (w, *_) in LAYOUTS.items()
                if w == world and layout in wanted
                for case in CASES for impl in ("torch", "triton")]
        return dict(zip(keys, run_layouts([make_run(*k) for k in keys], world_size=world,
                                          steps=STEPS)))

    return PerWorld(train)


@pytest.mark.parametrize("layout", layout_params(LAYOUTS, __name__, default="tp1"))
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_trains_like_torch(case, layout, results):
    runs = results(LAYOUTS[layout][0])
    ours, ref = runs[(case, layout, "triton")], runs[(case, layout, "torch")]
    assert len(ours["losses"]) == STEPS and ref["losses"][0] != ref["losses"][-1]  # it trains
    assert_same_training(ours, ref, f"{case} {layout}", loss_rtol=1e-4, grad_rtol=GRAD_RTOL)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_attnres_uses_the_resolved_impl(impl, megatron_single):
    from depthmix.kernels.attnres import attnres_reference, attnres_triton
    from depthmix.testing import build_model, tiny_run

    run = tiny_run("attnres_full")
    run.mixer.impl = impl
    ops = {m.attnres for m in build_model(run).modules() if hasattr(m, "attnres")}
    assert ops == {attnres_triton if impl == "triton" else attnres_reference}


def test_moda_impl_selects_the_kernel(megatron_single):
    """``mixer.impl`` (and ``mixer.moda_kernel``) pick the op once, at construction: every
    MoDA core attention of a ``triton`` model holds the split path (``moda_kernel=fused``:
    the fused kernel), of a ``torch`` model the reference."""
    from depthmix.kernels.moda_attention import (
        moda_attention_fused,
        moda_attention_reference,
        moda_attention_triton,
    )
    from depthmix.mixers.moda.model import MoDACoreAttention
    from depthmix.testing import build_model, tiny_run

    for options, expected in (({"impl": "triton"}, moda_attention_triton),
                              ({"impl": "triton", "moda_kernel": "fused"}, moda_attention_fused),
                              ({"impl": "torch", "moda_kernel": "fused"},
                               moda_attention_reference)):
        model = build_model(tiny_run("moda", **options))
        cores = [m for m in model.modules() if isinstance(m, MoDACoreAttention)]
        assert len(cores) == 4 and all(c.moda_attention is expected for c in cores), options


@pytest.mark.parametrize("kernel", ["split", "fused"])
def test_moda_triton_model_matches_torch_model_in_process(megatron_single, kernel):
    """Same weights, one forward/backward of the whole model: logits and every parameter
    gradient of impl=triton (either Triton path) match impl=torch (fp32)."""
    from depthmix.testing import build_model, tiny_run

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


def _option(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_kernels_train_like_torch_on_the_gpu(case):
    """The kernels compiled for the GPU (no interpreter), bf16, the 1.5B widths (the kernels'
    head dims) at 4 layers: 3 steps with ``mixer.impl=triton`` give the losses of
    ``mixer.impl=torch`` within bf16's rounding (2e-2)."""
    from depthmix.config.load import compose_run
    from depthmix.pretrain.parallelize import destroy_model_parallel
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    mixer, variant = CASES[case]
    losses = {}
    for impl in ("torch", "triton"):
        run = compose_run(
            "model=1p5b", "model.num_layers=4", "model.seq_length=1024", "model.vocab_size=8192",
            "train.micro_batch_size=2", "train.global_batch_size=2", "train.precision=bf16",
            f"mixer={mixer}", *[f"mixer.{k}={_option(v)}" for k, v in variant.options.items()],
            "logger=none", "train.compile=false", f"mixer.impl={impl}")
        trainer = Trainer(run, data=SyntheticData(run), callbacks=[])
        losses[impl] = [trainer.train_one_step().loss for _ in range(3)]
        del trainer
        destroy_model_parallel()
        torch.cuda.empty_cache()
    diff = max(abs(a - b) for a, b in zip(losses["torch"], losses["triton"]))
    assert diff <= 2e-2, losses
