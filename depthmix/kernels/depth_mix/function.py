"""``depth_mix_triton``: the Triton depth step behind one ``torch.autograd.Function``.

Saved for backward: the inputs (activations that exist anyway: q/k/v are kept for
sequence attention's backward, the sources are depth state) and the softmax log-sum-exp,
``[s, b, ng]`` fp32. The weights are recomputed in backward; nothing of size ``S × T × d``
is stored.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from depthmix.kernels.depth_mix.reference import MIX_RULES, MIXED_STATES, Sources
from depthmix.kernels.depth_mix.triton import depth_mix_bwd, depth_mix_fwd


def _split(sources: Sources) -> Tuple[Tuple[Tensor, ...], bool]:
    """(autograd inputs, stacked?): a stacked ``[S, ...]`` buffer is one input, a list is S."""
    if sources is None:
        return (), False
    if isinstance(sources, Tensor):
        return (sources,), True
    return tuple(sources), False


def _views(inputs: Tuple[Tensor, ...], stacked: bool) -> Tuple[Tensor, ...]:
    return tuple(inputs[0].unbind(0)) if stacked else inputs


def _grads(grad: Optional[Tensor], n_inputs: int, stacked: bool) -> Tuple[Optional[Tensor], ...]:
    if grad is None:
        return (None,) * n_inputs
    return (grad,) if stacked else tuple(grad.unbind(0))


class DepthMixFunction(torch.autograd.Function):
    """Inputs ``(query, key, value, options, *key_inputs, *value_inputs)``; outputs the mixed
    tensors only: ``(key_out,)``, ``(value_out,)`` or ``(key_out, value_out)``."""

    @staticmethod
    def forward(ctx, query, key, value, options, *sources):
        softmax, mix_keys, mix_values, scale, n_k, k_stacked, v_stacked = options
        key_inputs, value_inputs = sources[:n_k], sources[n_k:]
        k_out, v_out, lse = depth_mix_fwd(
            query, key, value, _views(key_inputs, k_stacked), _views(value_inputs, v_stacked),
            softmax=softmax, mix_keys=mix_keys, mix_values=mix_values, scale=scale)
        ctx.options = options
        ctx.save_for_backward(query, key, value, lse, *sources)
        return tuple(t for t in (k_out, v_out) if t is not None)

    @staticmethod
    def backward(ctx, *grads):
        softmax, mix_keys, mix_values, scale, n_k, k_stacked, v_stacked = ctx.options
        query, key, value, lse, *sources = ctx.saved_tensors
        key_inputs, value_inputs = tuple(sources[:n_k]), tuple(sources[n_k:])
        grads = list(grads)
        dk_out = grads.pop(0) if mix_keys else None
        dv_out = grads.pop(0) if mix_values else None
        dq, dk, dv, dsk, dsv = depth_mix_bwd(
            query, key, value, _views(key_inputs, k_stacked), _views(value_inputs, v_stacked),
            lse, dk_out, dv_out, softmax=softmax, mix_keys=mix_keys, mix_values=mix_values,
            scale=scale)
        return (dq, dk, dv, None, *_grads(dsk, len(key_inputs), k_stacked),
                *_grads(dsv, len(value_inputs), v_stacked))


def _count(sources: Sources) -> int:
    if sources is None:
        return 0
    return sources.shape[0] if isinstance(sources, Tensor) else len(sources)


def depth_mix_triton(query: Tensor, key: Tensor, value: Tensor, src_keys: Sources = None,
                    src_values: Sources = None, *, mix_rule: str = "softmax",
                    mixed_state: str = "value", scale: Optional[float] = None
                    ) -> Tuple[Tensor, Tensor]:
    """Mix layer ``l``'s key/value with those of its depth sources at every token position.

    Same contract as :func:`depthmix.kernels.depth_mix.reference.depth_mix`, as one Triton
    launch forward and one backward:

    Args:
        query: ``[s, b, np, hn]`` the layer's queries (after QK-norm and RoPE), ``hn <= 256``.
        key, value: ``[s, b, ng, hn]`` the layer's own keys and values.
        src_keys: the ``S`` sources' raw keys, stacked ``[S, s, b, ng, hn]`` or a sequence of
            ``[s, b, ng, hn]`` tensors (read in place from their own base pointers). Needed
            for ``mix_rule="softmax"`` and the key-mixing states.
        src_values: the ``S`` sources' mixed values, same layout; needed for ``mixed_state``
            ``value`` and ``key_value``.
        mix_rule: ``softmax`` or ``uniform``.
        mixed_state: ``value``, ``key`` or ``key_value``.
        scale: score scale, default ``1 / sqrt(hn)``.

    Returns:
        ``(key_out, value_out)`` ``[s, b, ng, hn]`` in the input dtype; the unmixed one is
        the input tensor itself, and with ``S = 0`` both are (the op is skipped).

    Weights and accumulation in fp32 (fp64 for fp64 inputs).
    """
    if mix_rule not in MIX_RULES:
        raise ValueError(f"mix_rule={mix_rule!r} must be one of {MIX_RULES}")
    if mixed_state not in MIXED_STATES:
        raise ValueError(f"mixed_state={mixed_state!r} must be one of {MIXED_STATES}")
    softmax = mix_rule == "softmax"
    mix_keys = mixed_state in ("key", "key_value")
    mix_values = mixed_state in ("value", "key_value")
    n_keys, n_values = _count(src_keys), _count(src_values)
    n = n_values if mix_values else n_keys
    if mix_values and mix_keys and n_keys != n:
        raise ValueError(f"{n_keys} source keys for {n} source values")
    if n == 0:
        return key, value
    if softmax and n_keys != n:
        raise ValueError(f"softmax depth mixing needs the keys of all {n} sources")
    # only what the options read enters the graph
    key_inputs, k_stacked = _split(src_keys if (softmax or mix_keys) else None)
    value_inputs, v_stacked = _split(src_values if mix_values else None)
    for t in (*key_inputs, *value_inputs):
        if t.shape[-4:] != key.shape:
            raise ValueError(f"source of shape {tuple(t.shape)} does not match key "
                             f"{tuple(key.shape)}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    options = (softmax, mix_keys, mix_values, scale, len(key_inputs), k_stacked, v_stacked)
    outs = list(DepthMixFunction.apply(query, key, value, options, *key_inputs, *value_inputs))
    key_out = outs.pop(0) if mix_keys else key
    value_out = outs.pop(0) if mix_values else value
    return key_out, value_out
