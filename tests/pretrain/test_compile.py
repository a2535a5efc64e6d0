"""``train.compile``: regional compilation of each layer (CPU inductor).

* In one process: graph breaks and compiled bodies per layer stack, and no recompilation
  after the first step (a uniform stack compiles one body; a stack whose depth state grows
  with depth at most one per layer), beside an eager copy of the model.
* Parity with eager through the trainer (3 steps, losses within 1e-5 relative, step-1
  gradients within 1e-5 of the norm) for every mixer at TP1. The full lane: every mixer
  with full recomputation (the checkpoint wraps the compiled layer), at TP2+SP and at PP2,
  and Full AttnRes (its depth state grows with depth) at PP2 x VP2 and at DP2 with the
  distributed optimizer (about 6 minutes on 2 CPU cores with a warm inductor cache).
* ``mixer.impl=triton`` (the interpreter): the kernels, custom ops, stay inside each
  layer's graph (no graph break) and the losses are eager's, for the four kernel mixers
  (Full AttnRes by default, the others in the full lane).
* Refusals at start-up naming ``train.compile``.
"""

import pytest
import torch

from depthmix.config.schema import ConfigError
from depthmix.mixers import available
from depthmix.testing import assert_same_training, run_layouts, tiny_run

from layouts import full_except

# inductor runs the C++ compiler (one child process) when its cache misses
pytestmark = pytest.mark.multiproc(at_once=1)

MIXERS = ["vanilla", *sorted(set(available()) - {"vanilla"})]
OPTIONS = {"attnres_block": {"block_size": 4}}  # two blocks of 4 layers, one of 2


def _two_layers(run):
    """Compile time grows with the distinct layer bodies, not with the width."""
    run.model.num_layers = 2
    if hasattr(run.mixer, "stride"):  # Depth-Attention: re-derive from the new depth
        run.mixer.stride = None
    run.mixer.resolve(run.model)
    return run


def _run(mixer: str, compile_: str, **parallel):
    run = _two_layers(tiny_run(mixer, **OPTIONS.get(mixer, {})))
    run.train.compile = compile_
    run.train.micro_batch_size = 2
    run.train.global_batch_size = 4
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    return run


def _beside_eager(run, steps: int = 3):
    """One model eager and a copy with compiled layers, trained side by side (SGD on the
    summed token losses). Returns the compiled model, the losses of both, the step-1
    gradient error relative to the gradient norm, the compiled graphs after each step and
    the graph breaks by reason."""
    from torch._dynamo.utils import counters

    from depthmix.pretrain.compile import compile_layers
    from depthmix.testing import build_model

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = build_model(run)
    compiled = build_model(run)
    compiled.load_state_dict(eager.state_dict())
    compile_layers([compiled])
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    losses, graphs, grad_error = ([], []), [], None
    for _ in range(steps):
        for model, out in zip((eager, compiled), losses):
            loss = model(tokens, positions, labels=tokens).sum()
            loss.backward()
            out.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
        if grad_error is None:
            grads = [torch.cat([p.grad.flatten() for p in m.parameters()])
                     for m in (eager, compiled)]
            grad_error = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
        with torch.no_grad():
            for p in (*eager.parameters(), *compiled.parameters()):
                p -= 1e-2 * p.grad
                p.grad = None
    return compiled, losses, grad_error, graphs, dict(counters["graph_break"])


@pytest.mark.parametrize("mixer", full_except(["vanilla", "mhc", "attnres_full"],
                                              {"vanilla", "attnres_full"}))
def test_one_body_per_distinct_layer_and_no_graph_break(megatron_single, mixer):
    model, (eager, compiled), grad_error, graphs, breaks = _beside_eager(
        tiny_run(mixer, **OPTIONS.get(mixer, {})))
    assert not breaks, breaks
    layers = model.config.num_layers
    if mixer == "attnres_full":  # each layer reads one more source: its own body, once
        assert 1 < graphs[0] <= layers, graphs
    else:  # a uniform stack: the 4 layers share one body
        assert graphs[0] == 1, graphs
    assert graphs[1] == graphs[2] == graphs[0], f"recompiled after the first step: {graphs}"
    assert compiled == pytest.approx(eager, rel=1e-5) and grad_error < 1e-5


@pytest.mark.parametrize("mixer", full_except(["depth_attn", "moda", "attnres_full", "mhc"],
                                              {"attnres_full"}))
def test_triton_kernels_inside_compiled_layers(megatron_single, mixer):
    """``mixer.impl=triton`` (the interpreter) under compilation: each kernel is a custom op
    inside its layer's graph, so no layer breaks its graph, nothing recompiles after the
    first step, and the losses and gradients are eager's."""
    run = _two_layers(tiny_run(mixer, impl="triton"))
    _, (eager, compiled), grad_error, graphs, breaks = _beside_eager(run, steps=2)
    assert not breaks, breaks
    assert 1 <= graphs[0] <= run.model.num_layers and graphs[-1] == graphs[0], graphs
    assert compiled == pytest.approx(eager, rel=1e-4), (compiled, eager)
    assert grad_error < 1e-4


def test_parameters_and_state_dict_keys_unchanged(megatron_single):
    from depthmix.pretrain.compile import compile_layers
    from depthmix.testing import build_model

    model = build_model(tiny_run("mhc"))
    keys, params = list(model.state_dict()), list(model.parameters())
    compile_layers([model])
    assert list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(model.parameters(), params))


def _assert_parity(results, mixers, label):
    for i, mixer in enumerate(mixers):
        eager, compiled = results[2 * i], results[2 * i + 1]
        assert_same_training(compiled, eager, f"{mixer} {label}", loss_rtol=1e-5, grad_rtol=1e-5)


@pytest.mark.parametrize("recompute", full_except(["none", "full"], {"none"}))
def test_parity_every_mixer_at_tp1(recompute):
    """Every mixer, eager and compiled, in one process (one rank); ``full``: with full
    activation recomputation."""
    runs = [_run(mixer, c, recompute=recompute) for mixer in MIXERS for c in ("false", "true")]
    results = run_layouts(runs, world_size=1, timeout=1500)
    for i, mixer in enumerate(MIXERS):
        assert_same_training(results[2 * i + 1], results[2 * i], f"{mixer}/{recompute}",
                             1e-5, 1e-5)


def _interleaved(mixer, compile_):
    run = _run(mixer, compile_, pp=2, vp=2)  # four layers, one per chunk
    run.model.num_layers = 4
    run.mixer.resolve(run.model)
    return run


# two-rank layouts: label -> (mixers, run(mixer, compile)); one process group runs them all
TWO_RANKS = {
    "tp2-sp": (MIXERS, lambda m, c: _run(m, c, tp=2, sequence_parallel=True)),
    "pp2": (MIXERS, lambda m, c: _run(m, c, pp=2)),
    "pp2-vp2": (["attnres_full"], _interleaved),
    "dp2-distopt": (["attnres_full"], lambda m, c: _run(m, c, distributed_optimizer=True)),
}


@pytest.fixture(scope="module")
def two_ranks():
    """label -> [eager, compiled results per mixer], all from one group of two ranks."""
    runs = [make(m, c) for mixers, make in TWO_RANKS.values() for m in mixers
            for c in ("false", "true")]
    results = iter(run_layouts(runs, world_size=2, timeout=1500))
    return {label: [next(results) for _ in range(2 * len(mixers))]
            for label, (mixers, _) in TWO_RANKS.items()}


GROUP_TIMEOUT = pytest.mark.timeout(1500)  # the first test's setup trains the whole group


@GROUP_TIMEOUT
@pytest.mark.full
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_parity_parallel_layouts(layout, two_ranks):
    _assert_parity(two_ranks[layout], TWO_RANKS[layout][0], layout)


def test_refusals_name_the_option(monkeypatch):
    from depthmix.pretrain import preflight

    run = tiny_run("mhc", impl="triton")  # the kernels are custom ops: accepted
    run.train.compile = "true"
    preflight.check_compile(run)
    run = tiny_run("vanilla")
    run.train.compile = "true"
    monkeypatch.setattr(preflight, "COMPILE_MIN_TORCH", (99, 0))
    with pytest.raises(ConfigError, match=r"train.compile=true needs torch >= 99.0"):
        preflight.check_compile(run)
    monkeypatch.setattr(preflight, "COMPILE_MIN_TORCH", (2, 6))
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(preflight, "_has_cuda_device", lambda: False)
    with pytest.raises(ConfigError, match=r"train.compile=true on CPU needs a C\+\+ compiler"):
        preflight.check_compile(run)
    run.train.compile = "auto"  # decides for itself: off on CPU
    preflight.check_compile(run)


def test_command_line_values(tmp_path):
    from depthmix.config.load import compose_run
    from depthmix.pretrain.compile import enabled

    for value, on in (("true", True), ("True", True), ("false", False), ("auto", False)):
        run = compose_run("model=tiny", f"train.compile={value}")
        assert run.train.compile == value.lower() and enabled(run) is on
    with pytest.raises(ConfigError, match="train.compile='yes' is not one of auto, true, false"):
        from depthmix.config.validate import validate

        run = compose_run("model=tiny")
        run.train.compile = "yes"
        validate(run)


@GROUP_TIMEOUT
@pytest.mark.full
@pytest.mark.multiproc
def test_parity_interleaved_pipeline_and_distributed_optimizer(two_ranks):
    """The two layouts left: PP2 x VP2 (1F1B interleaved; four layers, one per chunk) and
    DP2 with the distributed optimizer, for a mixer whose depth state grows with depth."""
    for layout in ("pp2-vp2", "dp2-distopt"):
        _assert_parity(two_ranks[layout], ["attnres_full"], layout)
