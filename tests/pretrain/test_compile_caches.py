"""Dynamo caches of the compiled layers (``depthmix.pretrain.compile``): a layer call checks
the guards of its own body only, and no more bodies compile than the stack has distinct
layers. Dynamo only (``backend="eager"``): the guards and caches are Dynamo's, whatever
compiles the graphs."""

import pytest
import torch

from depthmix.testing import build_model, tiny_run


def _model(mixer: str, layers: int, loops: int = 1):
    run = tiny_run(mixer)
    run.model.num_layers, run.model.n_loops = layers, loops
    if hasattr(run.mixer, "stride"):  # Depth-Attention: re-derive from the new depth
        run.mixer.stride = None
    run.mixer.resolve(run.model)
    return build_model(run)


@pytest.mark.parametrize("mixer, layers, loops, groups, bodies", [
    ("vanilla", 4, 1, [4], 1),  # one body, shared
    ("mhc", 4, 1, [4], 1),
    ("vanilla", 2, 2, [2], 1),  # loops share the modules and the body
    ("attnres_full", 4, 1, [1] * 4, 1),  # each layer reads one more source: its own
    ("depth_attn", 8, 1, [1] * 8, 1),  # layers 1-3 read the same sources, not the same body
    ("attnres_full", 2, 2, [1] * 2, 2),  # one body per loop
])
def test_body_groups(megatron_single, mixer, layers, loops, groups, bodies):
    from depthmix.pretrain.compile import body_groups

    found = body_groups([_model(mixer, layers, loops)])
    assert [len(g) for g, _ in found] == groups
    assert {b for _, b in found} == {bodies}


def _entries(layer) -> int:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(layer.forward.__code__))


def test_a_layer_call_checks_its_own_body_only(megatron_single, monkeypatch):
    """Full AttnRes compiles one body per layer, each in its own cache; vanilla's layers
    share one code object and one body. Today's Module.compile alone would put both of
    Full AttnRes' bodies in the cache of ``DepthMixLayer.forward``."""
    from torch._dynamo.utils import counters

    from depthmix.megatron_ext.layer import DepthMixLayer
    from depthmix.pretrain import compile as compile_mod

    monkeypatch.setattr(compile_mod, "compile_options", lambda cuda_graphs=False: {
        "backend": "eager"})
    tokens = torch.randint(0, 128, (1, 16))
    positions = torch.arange(16)[None]
    for mixer, codes in (("attnres_full", 2), ("vanilla", 1)):
        model = _model(mixer, 2)
        assert compile_mod.compile_layers([model]) == 2
        assert torch._dynamo.config.recompile_limit == compile_mod.VARIANTS
        counters.clear()
        model(tokens, positions, labels=tokens).sum().backward()
        layers = [m for m in model.modules() if isinstance(m, DepthMixLayer)]
        assert len({id(layer.forward.__code__) for layer in layers}) == codes
        assert DepthMixLayer.forward.__code__ not in [layer.forward.__code__ for layer in layers]
        assert [_entries(layer) for layer in layers] == [1, 1], mixer
        assert counters["stats"]["unique_graphs"] == codes  # no more bodies than layers differ
        assert not counters["graph_break"], dict(counters["graph_break"])


def test_state_dict_unchanged_and_compiling_twice(megatron_single, monkeypatch):
    from depthmix.pretrain import compile as compile_mod

    monkeypatch.setattr(compile_mod, "compile_options", lambda cuda_graphs=False: {
        "backend": "eager"})
    model = _model("attnres_full", 2)
    keys = list(model.state_dict())
    compile_mod.compile_layers([model])
    compile_mod.compile_layers([model])  # copies of the class's forward, not of a copy
    assert list(model.state_dict()) == keys
    assert all(layer.forward.__func__.__name__.count("body") == 1
               for layer in model.decoder.layers)


def test_dwa_without_gradients_compiles_whole():
    """DenseFormer's depth-weighted average under ``no_grad`` (evaluation, recompute's
    forward) traces without a graph break: a break would recompile every layer's inner
    frames in shared caches, past the per-body recompile limit."""
    from depthmix.mixers.denseformer.model import depth_weighted_average

    xs = [torch.randn(3, 2, 8) for _ in range(3)]
    alpha = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
    compiled = torch.compile(depth_weighted_average, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(xs, alpha), depth_weighted_average(xs, alpha))
    torch.testing.assert_close(compiled(xs, alpha), depth_weighted_average(xs, alpha))
