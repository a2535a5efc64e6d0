"""Regional compilation (``train.compile``): ``torch.compile`` of every transformer layer.

Each :class:`~depthmix.megatron_ext.layer.DepthMixLayer` is compiled in place
(``Module.compile``), as torchtitan compiles each transformer block: the norms, SwiGLU, RoPE,
residual adds and a mixer's elementwise depth work fuse into a few kernels, while the
pipeline schedule, the depth-state transport and the loss stay eager. Layers with the same
structure share one compiled body (parameters are graph inputs, not constants); a mixer
whose depth state differs from layer to layer (Full/Block AttnRes, DenseFormer, MoDA: the
number of sources grows with depth) compiles one body per distinct layer, never more.
Recompiling beyond that is an error (``fail_on_recompile_limit_hit``), not a silent fall
back to eager halfway through a run. With ``mixer.impl=triton`` the fused kernels sit in a
layer's graph as custom ops (``torch.library``, see :mod:`depthmix.kernels._common`):
opaque nodes that Inductor fuses around, with no graph break.

Where (:func:`depthmix.pretrain.parallelize.build_model`): after the chunks are built and
on their device, before ``Float16Module`` and DDP wrap them. ``Module.compile`` keeps the
module, its parameters and its state-dict keys (no ``_orig_mod.`` prefix), so DDP's
gradient buckets, the distributed optimizer and checkpoints see the eager model's
parameters; Float16Module's casts and DDP's hooks stay outside the compiled region, where
they must run once per step, not per layer.
"""

from __future__ import annotations

from typing import List

import torch

from depthmix.config.schema import RunConfig

_layers_compiled = 0


def enabled(run: RunConfig) -> bool:
    """``true``, or ``auto`` on CUDA (the start-up checks are
    :func:`depthmix.pretrain.preflight.check_compile`)."""
    mode = run.train.compile
    if mode == "auto":
        return torch.cuda.is_available()
    return mode == "true"


def compile_layers(chunks: List[torch.nn.Module]) -> int:
    """Compile every DepthMixLayer of ``chunks`` in place; returns how many."""
    import torch._dynamo

    from depthmix.megatron_ext.layer import DepthMixLayer

    global _layers_compiled
    _quiet_default_tp_group()
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, DepthMixLayer)]
    for layer in layers:
        layer.compile()
    # every compiled layer may add one body to the shared cache of DepthMixLayer.forward, in
    # two variants: with gradients (training) and without (evaluation, recompute's forward);
    # anything beyond that is a recompilation bug, which must fail rather than run eager
    _layers_compiled += len(layers)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 2 * _layers_compiled + 1)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit,
                                             4 * _layers_compiled)
    config.fail_on_recompile_limit_hit = True
    # the layer index (ForwardContext.layer) decides a layer's sources: a constant of its
    # body, never a symbolic int (which would break the graph at every f"...{layer}" name)
    config.specialize_int = True
    return len(layers)


def _quiet_default_tp_group() -> None:
    """Megatron's RowParallelLinear asks for "the default TP group" with a deprecation
    warning on rank 0 every call; ``warnings.warn`` breaks the compiled graph there. Return
    the same group without the warning."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    original = layers.get_tensor_model_parallel_group_if_none
    if getattr(original, "_depthmix_quiet", False):
        return

    def tp_group_or_default(tp_group, is_expert=False, check_initialized=True):
        if tp_group is not None or not parallel_state.is_initialized():
            return original(tp_group, is_expert, check_initialized)
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(
                check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    tp_group_or_default._depthmix_quiet = True
    layers.get_tensor_model_parallel_group_if_none = tp_group_or_default
