"""Regional compilation (``train.compile``): ``torch.compile`` of every transformer layer.

Each :class:`~depthmix.megatron_ext.layer.DepthMixLayer` is compiled in place
(``Module.compile``), as torchtitan compiles each transformer block: the norms, SwiGLU, RoPE,
residual adds and a mixer's elementwise depth work fuse into a few kernels, while the
pipeline schedule, the depth-state transport and the loss stay eager. Layers with the same
structure share one compiled body (parameters are graph inputs, not constants); a mixer
whose depth state differs from layer to layer (Full/Block AttnRes, DenseFormer, MoDA: the
number of sources grows with depth) compiles one body per distinct layer, never more. Each
body sits in a Dynamo cache of its own (:func:`body_groups`), so a layer call checks the
guards of its own body, not of all of them. Recompiling beyond that is an error
(``fail_on_recompile_limit_hit``), not a silent fall back to eager halfway through a run.
With ``mixer.impl=triton`` the fused kernels sit in a layer's graph as custom ops
(``torch.library``, see :mod:`depthmix.kernels._common`): opaque nodes that Inductor fuses
around, with no graph break.

Where (:func:`depthmix.pretrain.parallelize.build_model`): after the chunks are built and
on their device, before ``Float16Module`` and DDP wrap them. ``Module.compile`` keeps the
module, its parameters and its state-dict keys (no ``_orig_mod.`` prefix), so DDP's
gradient buckets, the distributed optimizer and checkpoints see the eager model's
parameters; Float16Module's casts and DDP's hooks stay outside the compiled region, where
they must run once per step, not per layer.

CUDA graphs (``train.cuda_graphs``) go around the same compiled layers: each is compiled in
``torch.compile``'s ``reduce-overhead`` mode, whose CUDA-graph trees record the layer's
forward and backward kernels once and replay them, so a layer's launches cost one graph
launch of host time. Chosen over Megatron-Core's own CUDA-graph manager
(``enable_cuda_graph``/``cuda_graph_impl="local"``), which graphs Megatron's
``TransformerLayer`` by flattening its tensor arguments: a depthmix layer takes a depth state
(a dict whose entries vary by mixer and layer) and a forward context, and the regional
compilation above already gives each distinct layer one graph to record. What stays
outside the graphs, as it must: the pipeline schedule and its communication, DDP's gradient
hooks (they fire on each parameter's gradient accumulation, after the graphed backward), the
loss and the optimizer. :func:`step_begin` tells the graph trees where each step starts.
Only on a GPU (refused at start-up otherwise: :func:`depthmix.pretrain.preflight.
check_cuda_graphs`); what a GPU run must check is in docs/operations.md ("Fast path").
"""

from __future__ import annotations

import types
from typing import List, Tuple

import torch

from depthmix.config.schema import RunConfig
from depthmix.runtime.device import switch_on

VARIANTS = 3
"""Compiled variants of one body: with gradients (training, recompute's backward), without
on inputs that require them (recompute's forward), and without on inputs that do not
(evaluation)."""

_graphed = {"on": False}
"""Whether the layers compiled last (:func:`compile_layers`) record CUDA graphs. Dynamo's
caches are process-global, and :func:`compile_layers` resets them for each model."""


def enabled(run: RunConfig) -> bool:
    """``true``, or ``auto`` on CUDA without experts (Megatron's MoE dispatch has
    data-dependent shapes; the start-up checks are
    :func:`depthmix.pretrain.preflight.check_compile`)."""
    if run.train.compile == "auto" and run.model.experts is not None:
        return False
    return switch_on(run.train.compile)


def compile_options(cuda_graphs: bool = False) -> dict:
    """Keyword arguments of each layer's ``Module.compile``: ``mode="reduce-overhead"``
    (CUDA-graph trees) with ``cuda_graphs``, else the default mode."""
    return {"mode": "reduce-overhead"} if cuda_graphs else {}


def step_begin() -> None:
    """A training or evaluation step starts: with CUDA graphs, the graph trees may reuse the
    memory of the previous step's graph outputs (``torch.compiler.cudagraph_mark_step_begin``).
    Nothing otherwise."""
    if _graphed["on"]:
        torch.compiler.cudagraph_mark_step_begin()


def cuda_graph_skips() -> int:
    """How many compiled graphs inductor ran without a CUDA graph since the last
    :func:`compile_layers` (a CPU input, a mutated input, a dynamic shape, ...; its log
    ``perf_hints`` says which). With ``train.cuda_graphs`` on a GPU this must stay 0."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def body_groups(chunks: List[torch.nn.Module]) -> List[Tuple[list, int]]:
    """The DepthMixLayers of ``chunks``, grouped by the compiled body they share, each group
    with how many bodies it compiles (each in up to :data:`VARIANTS` variants).

    Dynamo keeps a code object's compiled bodies in one cache, and a call checks the guards
    of each cached body until one passes. What a layer's body specialises on besides its
    module structure is the depth state at its boundary (:class:`~depthmix.planning.
    depth_plan.DepthPlan`): where the plan is the same at every unrolled layer (vanilla,
    mHC, DDL), all layers of a class share one body and one group; where it differs
    anywhere (Full/Block AttnRes, DenseFormer, Depth-Attention, MoDA), the mixer reads the
    unrolled index (``ForwardContext.layer``, a constant of the body), so every layer
    compiles its own body, one per loop, and forms its own group."""
    from depthmix.megatron_ext.layer import DepthMixLayer
    from depthmix.megatron_ext.model import DepthMixBlock

    groups = {}
    for block in (m for chunk in chunks for m in chunk.modules()):
        if not isinstance(block, DepthMixBlock):
            continue
        plan = block.plan
        uniform = len({_boundary(plan, u) for u in range(plan.num_layers)}) == 1
        bodies = 1 if uniform else block.config.n_loops
        for layer in block.layers:
            if isinstance(layer, DepthMixLayer):
                groups.setdefault(type(layer) if uniform else layer, ([], bodies))[0].append(layer)
    return list(groups.values())


def _boundary(plan, u: int) -> tuple:
    """What the depth state looks like to unrolled layer ``u``: the entries live on entering
    it, and those it reads and writes."""
    reads = frozenset(e.name for e in plan.entries.values() if u in e.readers)
    writes = frozenset(e.name for e in plan.entries.values() if u in e.writers)
    return plan.live_names(u), reads, writes


def _own_forward(layer_class: type, tag: str):
    """``layer_class.forward`` with a code object of its own (Dynamo's cache lives on the
    code object; ``co_name`` differs so that the copy is not equal to the original)."""
    forward = layer_class.forward
    code = forward.__code__.replace(co_name=f"forward_{tag}")
    own = types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__,
                             forward.__closure__)
    own.__kwdefaults__, own.__qualname__ = forward.__kwdefaults__, f"{forward.__qualname__}_{tag}"
    return own


def compile_layers(chunks: List[torch.nn.Module], cuda_graphs: bool = False) -> int:
    """Compile every DepthMixLayer of ``chunks`` in place (:func:`compile_options`; CUDA
    graphs with ``cuda_graphs``); returns how many.

    Each group of :func:`body_groups` runs a copy of ``forward`` of its own, whose Dynamo
    cache holds its body only, in up to :data:`VARIANTS` variants (training, recompute,
    evaluation): a layer call checks the guards of its own body, not of every body of the
    model. Dynamo's per-code limit (``recompile_limit``, process-wide) is set to that:
    anything beyond is a recompilation bug, which must fail rather than run eager, whatever
    the depth. Dynamo's caches are reset first, so bodies compiled for an earlier model in
    this process (a multirun's previous job, a test) do not count against this one.
    (Megatron's default-TP-group warning, which would break the graph, is silenced by
    :class:`depthmix.runtime.patches.QuietTpGroup`.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    groups = body_groups(chunks)
    torch._dynamo.reset()
    counters["inductor"].pop("cudagraph_skips", None)
    config = torch._dynamo.config
    config.recompile_limit = VARIANTS * max((bodies for _, bodies in groups), default=1)
    config.fail_on_recompile_limit_hit = True
    # the layer index (ForwardContext.layer) decides a layer's sources: a constant of its
    # body, never a symbolic int (which would break the graph at every f"...{layer}" name)
    config.specialize_int = True
    options = compile_options(cuda_graphs)
    for i, (layers, _) in enumerate(groups):
        forward = _own_forward(type(layers[0]), f"body{i}")
        for layer in layers:
            layer.forward = types.MethodType(forward, layer)
            layer.compile(**options)
    _graphed["on"] = cuda_graphs
    return sum(len(layers) for layers, _ in groups)
