"""``depth_mix_triton``: the Triton depth step as one :class:`~depthmix.kernels._common.KernelOp`.

``depthmix::depth_mix_fwd`` and ``depthmix::depth_mix_bwd`` (``torch.library``) wrap the
launchers of ``triton.py``; the forward carries a registered autograd formula that calls
the backward op, and both have fake implementations, so ``torch.compile`` places them in a
compiled layer's graph without a graph break; eager calls run the same launchers through a
plain ``autograd.Function`` (see :mod:`depthmix.kernels._common`).

Saved for backward: the inputs (activations that exist anyway: q/k/v are kept for
sequence attention's backward, the sources are depth state) and the softmax log-sum-exp,
``[s, b, ng]`` fp32. The weights are recomputed in backward; nothing of size ``S × T × d``
is stored.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from depthmix.kernels._common import KernelOp, absent, acc_dtype, empty_like_contiguous, present
from depthmix.kernels.depth_mix.reference import Sources
from depthmix.kernels.depth_mix.triton import depth_mix_bwd, depth_mix_fwd
from depthmix.kernels.modes import MIX_RULES, MIXED_STATES


def _views(inputs: Sequence[Tensor], stacked: bool) -> Tuple[Tensor, ...]:
    """A stacked ``[S, ...]`` buffer enters the op as one tensor, a list as S."""
    return tuple(inputs[0].unbind(0)) if stacked else tuple(inputs)


def _grads(grad: Optional[Tensor], n_inputs: int, stacked: bool) -> List[Optional[Tensor]]:
    if grad is None:
        return [None] * n_inputs
    return [grad] if stacked else list(grad.unbind(0))


def _forward(query: Tensor, key: Tensor, value: Tensor, key_inputs: List[Tensor],
             value_inputs: List[Tensor], k_stacked: bool, v_stacked: bool, softmax: bool,
             mix_keys: bool, mix_values: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``(key_out, value_out, lse)``; an output the options do not produce is empty."""
    k_out, v_out, lse = depth_mix_fwd(
        query, key, value, _views(key_inputs, k_stacked), _views(value_inputs, v_stacked),
        softmax=softmax, mix_keys=mix_keys, mix_values=mix_values, scale=scale)
    return present(k_out, key), present(v_out, value), present(lse, key)


def _backward(query: Tensor, key: Tensor, value: Tensor, key_inputs: List[Tensor],
              value_inputs: List[Tensor], k_stacked: bool, v_stacked: bool, lse: Tensor,
              dk_out: Optional[Tensor], dv_out: Optional[Tensor], softmax: bool, mix_keys: bool,
              mix_values: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsrc_keys [S, ...], dsrc_values [S, ...])``; a gradient the forward
    did not depend on is empty."""
    grads = depth_mix_bwd(
        query, key, value, _views(key_inputs, k_stacked), _views(value_inputs, v_stacked),
        absent(lse), absent(dk_out), absent(dv_out),
        softmax=softmax, mix_keys=mix_keys, mix_values=mix_values, scale=scale)
    return tuple(present(g, like) for g, like in zip(grads, (query, key, value, key, value)))


def _eager_forward(query, key, value, key_inputs, value_inputs, k_stacked, v_stacked, softmax,
                   mix_keys, mix_values, scale):
    """:func:`_forward` outside a custom op: None for an output it does not produce."""
    return depth_mix_fwd(
        query, key, value, _views(key_inputs, k_stacked), _views(value_inputs, v_stacked),
        softmax=softmax, mix_keys=mix_keys, mix_values=mix_values, scale=scale)


def _eager_backward(query, key, value, key_inputs, value_inputs, k_stacked, v_stacked, lse,
                    dk_out, dv_out, softmax, mix_keys, mix_values, scale):
    """:func:`_backward` outside a custom op: None for a gradient it does not produce."""
    return depth_mix_bwd(
        query, key, value, _views(key_inputs, k_stacked), _views(value_inputs, v_stacked),
        lse, dk_out, dv_out, softmax=softmax, mix_keys=mix_keys, mix_values=mix_values,
        scale=scale)


def _setup_context(ctx, inputs, output):
    query, key, value, key_inputs, value_inputs, k_stacked, v_stacked, *options = inputs
    lse = output[2]
    if lse is not None:
        ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros for the lse's (or an unmixed output's) grad
    ctx.save_for_backward(query, key, value, lse, *key_inputs, *value_inputs)
    ctx.n_keys, ctx.stacked, ctx.options = len(key_inputs), (k_stacked, v_stacked), options


def _gradient(ctx, backward, dk_out, dv_out, _dlse):
    query, key, value, lse, *sources = ctx.saved_tensors
    key_inputs, value_inputs = sources[:ctx.n_keys], sources[ctx.n_keys:]
    (k_stacked, v_stacked), (softmax, mix_keys, mix_values, scale) = ctx.stacked, ctx.options
    if mix_keys and dk_out is None:  # grads are not materialised: one output unused
        dk_out = torch.zeros_like(key)
    if mix_values and dv_out is None:
        dv_out = torch.zeros_like(value)
    dq, dk, dv, dsk, dsv = (absent(g) for g in backward(
        query, key, value, key_inputs, value_inputs, k_stacked, v_stacked, lse, dk_out, dv_out,
        softmax, mix_keys, mix_values, scale))
    return (dq, dk, dv, _grads(dsk, len(key_inputs), k_stacked),
            _grads(dsv, len(value_inputs), v_stacked), None, None, None, None, None, None)


depth_mix_op = KernelOp("depthmix::depth_mix", _forward, _backward,
                        setup_context=_setup_context, gradient=_gradient,
                        eager_forward=_eager_forward, eager_backward=_eager_backward)


@depth_mix_op.forward_op.register_fake
def _(query, key, value, key_inputs, value_inputs, k_stacked, v_stacked, softmax, mix_keys,
      mix_values, scale):
    lse_dtype = acc_dtype(query.dtype)
    return (empty_like_contiguous(key) if mix_keys else key.new_empty(0),
            empty_like_contiguous(value) if mix_values else value.new_empty(0),
            key.new_empty(key.shape[:3], dtype=lse_dtype) if softmax else key.new_empty(0))


@depth_mix_op.backward_op.register_fake
def _(query, key, value, key_inputs, value_inputs, k_stacked, v_stacked, lse, dk_out, dv_out,
      softmax, mix_keys, mix_values, scale):
    uses_keys = softmax or mix_keys
    n = max(len(_views(key_inputs, k_stacked)), len(_views(value_inputs, v_stacked)))

    def new(like: Tensor, shape, needed: bool) -> Tensor:
        return like.new_empty(shape if needed else (0,))

    return (new(query, query.shape, softmax), new(key, key.shape, uses_keys),
            new(value, value.shape, mix_values), new(key, (n, *key.shape), uses_keys),
            new(value, (n, *value.shape), mix_values))


def _split(sources: Sources) -> Tuple[List[Tensor], bool]:
    """(op inputs, stacked?): a stacked ``[S, ...]`` buffer is one input, a list is S."""
    if sources is None:
        return [], False
    if isinstance(sources, Tensor):
        return [sources], True
    return list(sources), False


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
    key_out, value_out, _ = depth_mix_op(
        query, key, value, key_inputs, value_inputs, k_stacked, v_stacked, softmax, mix_keys,
        mix_values, scale)
    return (key_out if mix_keys else key), (value_out if mix_values else value)
