"""Host-side helpers shared by the Triton launchers (``kernels/<op>/triton.py``).

Nothing here imports Triton at module level, so the dispatcher can use it too.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``, tests only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / statistics dtype: fp32 for 16-bit and fp32 inputs, fp64 for fp64
    (like the references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_TL_DTYPES: dict = {}


def tl_dtype(dtype: torch.dtype):
    """The ``triton.language`` dtype of a torch float dtype (fp32 or fp64)."""
    if not _TL_DTYPES:
        import triton.language as tl

        _TL_DTYPES.update({torch.float32: tl.float32, torch.float64: tl.float64})
    return _TL_DTYPES[dtype]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs the
    programs one after another)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None
                              else torch.cuda.current_device())
    return 1


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Triton's own ``triton.cdiv`` / ``triton.next_power_of_2`` are constexpr functions: each
# host call unwraps its arguments first, several µs a launch.
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``triton.cdiv`` on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length()


def last_dim_contiguous(*tensors: Optional[Tensor]) -> List[Optional[Tensor]]:
    """Each tensor with unit stride in its last dim (a copy only where it has not; None
    passes through): what the kernels' row loads assume."""
    return [t if t is None or t.stride(-1) == 1 else t.contiguous() for t in tensors]


# ---- custom ops ---------------------------------------------------------------------------
# Each op's launchers run behind ``torch.library.custom_op`` (``<op>/function.py``): an
# opaque node with a fake implementation (output shapes, dtypes and strides, for tracing)
# and a registered autograd formula whose backward is itself a custom op. ``torch.compile``
# then keeps a Triton op inside a compiled layer's graph instead of breaking it there, and
# Inductor fuses the PyTorch work around it. ``custom_op`` rather than ``triton_op``: the
# launchers pick tiles on the host and attnres passes its sources as a table of
# ``data_ptr()`` values, which Inductor cannot trace (and need not: the kernel is already
# fused). A custom op's schema has no optional outputs, so an output the options do not
# produce is an empty 1-D tensor on the way out (:func:`present`) and None again once
# outside (:func:`absent`); no real output or gradient of these ops is 1-D and empty.
#
# Eager calls do not need the custom op, and pay for it: the dispatcher, the autograd
# wrapper torch.library generates and its flattening of tensor lists make a forward +
# backward cost a third to a half more host time than the same launchers under a plain
# ``torch.autograd.Function`` (``tools/bench_host.py --ops-only``). :class:`KernelOp`
# registers both from one definition and picks per call.


def empty_like_contiguous(t: Tensor) -> Tensor:
    """What a launcher allocates for an output shaped like ``t`` (a fake implementation's
    output): same shape, dtype and device, contiguous strides."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def present(t: Optional[Tensor], like: Tensor) -> Tensor:
    """``t``, or an empty 1-D placeholder of ``like``'s dtype and device for None."""
    return like.new_empty(0) if t is None else t


def absent(t: Optional[Tensor]) -> Optional[Tensor]:
    """None for a :func:`present` placeholder (or None), else ``t``."""
    return None if t is None or (t.dim() == 1 and t.numel() == 0) else t


_custom_ops_in_eager = False


@contextlib.contextmanager
def custom_ops_in_eager():
    """Eager calls of every :class:`KernelOp` go through its custom op, as compiled graphs
    do, instead of its ``autograd.Function`` (tests of the two paths, host-time
    comparisons)."""
    global _custom_ops_in_eager
    before, _custom_ops_in_eager = _custom_ops_in_eager, True
    try:
        yield
    finally:
        _custom_ops_in_eager = before


class KernelOp:
    """A kernel's forward and backward launchers as one differentiable op with two entry
    points that run the same Python bodies:

    * the ``torch.library`` custom ops ``<name>_fwd`` / ``<name>_bwd`` (register their fake
      implementations on :attr:`forward_op` / :attr:`backward_op`) with ``gradient`` as the
      forward's registered autograd formula: what ``torch.compile`` traces, one opaque node
      in a compiled graph, no graph break;
    * a plain ``torch.autograd.Function`` whose forward calls ``forward`` and whose backward
      calls ``backward`` directly: eager calls.

    Calling the ``KernelOp`` picks the custom op while Dynamo traces
    (``torch.compiler.is_compiling()``, a constant in the traced code) or inside
    :func:`custom_ops_in_eager`, else the Function; both give the same outputs and
    gradients (the same launchers run).

    Args:
        name: ``"<namespace>::<op>"``.
        forward: the forward op's body; its annotations are the schema (tensor-list inputs
            are fine: the Function flattens them, as autograd only sees top-level tensors).
        backward: the backward op's body.
        setup_context: ``(ctx, inputs, output)``, as for ``register_autograd``.
        gradient: ``(ctx, backward, *output_grads)`` -> one gradient (or None) per input of
            ``forward``, a list (or None) for a tensor-list input; computes them by calling
            ``backward`` (the backward custom op when traced, its body eagerly).
        eager_forward, eager_backward: the bodies the Function calls instead (same
            arguments), where eager calls can do with less than a custom op's contract:
            None for an output the options do not produce (no empty placeholder), outputs
            that are views of one buffer (one allocation). ``setup_context`` and
            ``gradient`` take both kinds.

    Usage (``kernels/<op>/function.py``)::

        my_op = KernelOp("depthmix::my_op", _forward, _backward,
                         setup_context=_setup_context, gradient=_gradient)

        @my_op.forward_op.register_fake
        def _(x, ...): ...

        out = my_op(x, ...)
    """

    def __init__(self, name: str, forward: Callable, backward: Callable, *,
                 setup_context: Callable, gradient: Callable,
                 eager_forward: Optional[Callable] = None,
                 eager_backward: Optional[Callable] = None):
        namespace, op = name.split("::")
        self.forward_op = torch.library.custom_op(f"{name}_fwd", forward, mutates_args=())
        self.backward_op = torch.library.custom_op(f"{name}_bwd", backward, mutates_args=())
        ops = getattr(torch.ops, namespace)
        self._traced = getattr(ops, f"{op}_fwd").default
        traced_backward = getattr(ops, f"{op}_bwd").default
        self.forward_op.register_autograd(
            lambda ctx, *grads: gradient(ctx, traced_backward, *grads),
            setup_context=setup_context)
        schema = self._traced._schema.arguments
        self._lists = tuple(i for i, a in enumerate(schema) if str(a.type) == "List[Tensor]")
        self._function = _eager_function(
            f"{op}_function", eager_forward or forward, eager_backward or backward,
            setup_context, gradient, self._lists)

    def __call__(self, *args):
        if torch.compiler.is_compiling() or _custom_ops_in_eager:
            return self._traced(*args)
        if not self._lists:
            return self._function.apply(*args)
        lengths = tuple(len(args[i]) for i in self._lists)
        return self._function.apply(lengths, *_flatten(args, self._lists))


def _flatten(args: Sequence, lists: Tuple[int, ...]) -> list:
    flat = []
    for i, a in enumerate(args):
        if i in lists:
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def _unflatten(flat: Sequence, lists: Tuple[int, ...], lengths: Tuple[int, ...]) -> list:
    args, at = [], 0
    for i in range(len(flat) - sum(lengths) + len(lengths)):
        if i in lists:
            n = lengths[lists.index(i)]
            args.append(list(flat[at:at + n]))
            at += n
        else:
            args.append(flat[at])
            at += 1
    return args


def _eager_function(name: str, forward, backward, setup_context, gradient, lists):
    """The ``autograd.Function`` of a :class:`KernelOp`; with tensor-list inputs it takes
    ``(lengths, *flattened inputs)``. ``forward(ctx, ...)`` calls ``setup_context`` itself:
    a Function that defines ``setup_context`` binds its arguments through
    ``inspect.signature`` on every call."""

    if not lists:
        def plain_forward(ctx, *inputs):
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            return output

        def plain_backward(ctx, *grads):
            return gradient(ctx, backward, *grads)

        body = dict(forward=staticmethod(plain_forward), backward=staticmethod(plain_backward))
        return type(name, (torch.autograd.Function,), body)

    def flat_forward(ctx, lengths, *flat):
        inputs = _unflatten(flat, lists, lengths)
        output = forward(*inputs)
        ctx.lengths = lengths
        setup_context(ctx, inputs, output)
        return output

    def flat_backward(ctx, *grads):
        out = [None]  # the lengths
        for i, g in enumerate(gradient(ctx, backward, *grads)):
            if i in lists:
                out.extend([None] * ctx.lengths[lists.index(i)] if g is None else g)
            else:
                out.append(g)
        return tuple(out)

    body = dict(forward=staticmethod(flat_forward), backward=staticmethod(flat_backward))
    return type(name, (torch.autograd.Function,), body)
