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


def host_cache(fn: Callable) -> Callable:
    """``functools.lru_cache`` for a launcher's pure helper of sizes and dtypes (tiles,
    paddings: the same every step), computed anew where an argument is not hashable
    (the symbolic sizes of a traced call)."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return cached(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)

    return call


@functools.lru_cache(maxsize=None)
def built_interpreted() -> bool:
    """:func:`interpreting` read once: the mode ``triton.jit`` built this process's kernels
    in (it decides when a kernel module is imported), for the launchers' tile choices at
    every call (an environment lookup a launch otherwise)."""
    return interpreting()


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


def add_to_main_grads(params: Sequence[Optional[Tensor]],
                      grads: Sequence[Optional[Tensor]]) -> Tuple[Optional[Tensor], ...]:
    """Parameter gradients computed by a kernel op, accumulated the way Megatron's own
    linear layers do with ``gradient_accumulation_fusion``: where Megatron's DDP gave a
    parameter a ``main_grad`` buffer (it sets ``grad_added_to_main_grad`` on every
    parameter it holds), its gradient is added to it here and flagged, so the DDP's
    gradient hook skips its own ``param.grad.data`` and add. The gradients come back
    either way, as the ones autograd hands the parameters (placeholders under the flag,
    dropped by the hook). Eager calls only (a compiled graph may not write ``main_grad``)."""
    if torch.compiler.is_compiling():
        return tuple(grads)
    for param, grad in zip(params, grads):
        if (grad is not None and hasattr(param, "grad_added_to_main_grad")
                and not getattr(param, "zero_out_wgrad", False)):
            param.main_grad.add_(grad)
            param.grad_added_to_main_grad = True
    return tuple(grads)


def last_dim_contiguous(*tensors: Optional[Tensor]) -> List[Optional[Tensor]]:
    """Each tensor with unit stride in its last dim (a copy only where it has not; None
    passes through): what the kernels' row loads assume."""
    return [t if t is None or t.stride(-1) == 1 else t.contiguous() for t in tensors]


# ---- custom ops ---------------------------------------------------------------------------
# Each op's launchers run behind a ``torch.library`` op (``<op>/function.py``): an opaque
# node with a fake implementation (output shapes, dtypes and strides, for tracing) and an
# autograd formula whose backward is itself such an op. ``torch.compile`` then keeps a Triton
# op inside a compiled layer's graph instead of breaking it there, and Inductor fuses the
# PyTorch work around it. Not ``triton_op``: the launchers pick tiles on the host and
# attnres passes its sources as a table of ``data_ptr()`` values, which Inductor cannot
# trace (and need not: the kernel is already fused). An op's schema has no optional
# outputs, so an output the options do not produce is an empty 1-D tensor on the way out
# (:func:`present`) and None again once outside (:func:`absent`); no real output or
# gradient of these ops is 1-D and empty.
#
# The ops are defined on the dispatcher directly (``Library.define`` / ``impl``), not
# through ``torch.library.custom_op``, whose generated autograd kernel flattens every call's
# arguments with pytree, re-adds default arguments and wraps the body in an aliasing check:
# a forward + backward through it cost about twice the same launchers under a plain
# ``torch.autograd.Function`` (``tools/bench_host.py --ops-only``). Here the autograd kernel
# is that Function with a redispatch in its forward, and the bodies are the kernels.
#
# Eager calls need no op at all: :class:`KernelOp` picks the plain Function there.


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


_LIBRARIES: dict = {}


class LibraryOp:
    """A functional operator ``<namespace>::<name>`` whose schema is ``body``'s annotations
    (``torch.library.infer_schema``) and whose kernel, on every device, is ``body`` itself.

    ``default`` is its ``OpOverload``; :meth:`register_fake` adds the fake implementation.
    No autograd kernel: the dispatcher's fallback (a backward op, or one called inside an
    ``autograd.Function``); :class:`KernelOp` adds one to its forward op."""

    def __init__(self, qualname: str, body: Callable):
        namespace, self.name = qualname.split("::")
        if namespace not in _LIBRARIES:
            _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        self.lib = _LIBRARIES[namespace]
        self.qualname = qualname
        schema = torch.library.infer_schema(body, mutates_args=())
        self.lib.define(self.name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        self.lib.impl(self.name, body, "CompositeExplicitAutograd")
        self.default = getattr(getattr(torch.ops, namespace), self.name).default

    def register_fake(self, fake: Callable) -> Callable:
        """Decorator: ``fake`` (same arguments as the body) gives the outputs' metadata."""
        torch.library.register_fake(self.qualname, fake, lib=self.lib)
        return fake


class KernelOp:
    """A kernel's forward and backward launchers as one differentiable op with two entry
    points that run the same Python bodies:

    * the ``torch.library`` ops ``<name>_fwd`` / ``<name>_bwd`` (:class:`LibraryOp`: register
      their fake implementations on :attr:`forward_op` / :attr:`backward_op`) with an
      autograd kernel on the forward whose backward runs ``gradient`` with the backward op:
      what ``torch.compile`` traces, one opaque node in a compiled graph, no graph break;
    * a plain ``torch.autograd.Function`` whose forward calls ``forward`` and whose backward
      calls ``backward`` directly: eager calls.

    Calling the ``KernelOp`` picks the op while Dynamo traces
    (``torch.compiler.is_compiling()``, a constant in the traced code) or inside
    :func:`custom_ops_in_eager`, else the Function; both give the same outputs and
    gradients (the same launchers run).

    Args:
        name: ``"<namespace>::<op>"``.
        forward: the forward op's body; its annotations are the schema (tensor-list inputs
            are fine: the Functions flatten them, as autograd only sees top-level tensors).
        backward: the backward op's body.
        setup_context: ``(ctx, inputs, output)``, as for ``register_autograd``.
        gradient: ``(ctx, backward, *output_grads)`` -> one gradient (or None) per input of
            ``forward``, a list (or None) for a tensor-list input; computes them by calling
            ``backward`` (the backward op when traced, its body eagerly).
        eager_forward, eager_backward: the bodies the Function calls instead (same
            arguments), where eager calls can do with less than an op's contract: None for
            an output the options do not produce (no empty placeholder), outputs that are
            views of one buffer (one allocation). ``setup_context`` and ``gradient`` take
            both kinds.

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
        op = name.split("::")[1]
        self.forward_op = LibraryOp(f"{name}_fwd", forward)
        self.backward_op = LibraryOp(f"{name}_bwd", backward)
        self._traced = traced = self.forward_op.default
        arguments = traced._schema.arguments
        self._lists = tuple(i for i, a in enumerate(arguments) if str(a.type) == "List[Tensor]")
        self._function = _eager_function(
            f"{op}_function", eager_forward or forward, eager_backward or backward,
            setup_context, gradient, self._lists)
        self._eager_apply = _c_apply(self._function)
        self._op_function = _function(
            f"{op}_op_autograd", _redispatch(traced), self.backward_op.default, setup_context,
            gradient, self._lists)
        self.forward_op.lib.impl(self.forward_op.name, self._autograd_kernel(arguments),
                                 "Autograd", with_keyset=True)

    def __call__(self, *args):
        if _custom_ops_in_eager or torch.compiler.is_compiling():
            return self._traced(*args)
        lists = self._lists
        if lists:
            args = (tuple(len(args[i]) for i in lists), *_flatten(args, lists))
        if torch._C._are_functorch_transforms_active():  # vmap, grad, ...: the full apply
            return self._function.apply(*args)
        return self._eager_apply(*args)

    def _autograd_kernel(self, arguments) -> Callable:
        """The forward op's kernel at the Autograd key: the op Function where a gradient is
        needed, else straight to the kernels below autograd. The dispatcher drops trailing
        arguments equal to their defaults; ``setup_context`` gets them back."""
        function, lists, traced = self._op_function, self._lists, self._traced
        n = len(arguments)
        defaults = tuple(a.default_value for a in arguments)

        def kernel(keyset, *args):
            if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
                if len(args) < n:
                    args = args + defaults[len(args):]
                return _apply(function, keyset, args, lists)
            with torch._C._AutoDispatchBelowAutograd():
                return traced.redispatch(keyset & torch._C._after_autograd_keyset, *args)

        return kernel


def _redispatch(op) -> Callable:
    """``forward(keyset, *inputs)`` of the op Function: ``op``'s kernels below autograd
    (the launchers, or the fake implementation while tracing)."""

    def forward(keyset, *inputs):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *inputs)

    return forward


def _apply(function, keyset, args: Sequence, lists: Tuple[int, ...]):
    if not lists:
        return function.apply(keyset, *args)
    lengths = tuple(len(args[i]) for i in lists)
    return function.apply(keyset, lengths, *_flatten(args, lists))


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


def _c_apply(function) -> Callable:
    """``function.apply`` less its Python wrapper (which binds default arguments, checks for
    functorch transforms and unwraps their dead wrappers, a few µs a call): the C++ apply
    itself, bound to ``function``. Callers check ``_are_functorch_transforms_active()``
    first; a torch without it at that place gets the full apply."""
    apply = torch._C._FunctionBase.__dict__.get("apply")
    if apply is None or not hasattr(apply, "__get__"):
        return function.apply
    return apply.__get__(None, function)


def _eager_function(name: str, body, backward, setup_context, gradient, lists):
    """The ``autograd.Function`` eager calls of a :class:`KernelOp` run, applied as
    ``(*inputs)`` or, with tensor-list inputs, ``(lengths, *flattened inputs)``: one Python
    frame from the Function to the body each way (``forward`` calls ``setup_context``
    itself: a Function that defines ``setup_context`` binds its arguments through
    ``inspect.signature`` on every call)."""
    if not lists:
        def forward(ctx, *inputs):
            output = body(*inputs)
            setup_context(ctx, inputs, output)
            return output

        def backward_(ctx, *grads):
            return gradient(ctx, backward, *grads)
    else:
        def forward(ctx, lengths, *flat):
            inputs = _unflatten(flat, lists, lengths)
            output = body(*inputs)
            ctx.lengths = lengths
            setup_context(ctx, inputs, output)
            return output

        def backward_(ctx, *grads):
            return (None, *_flat_grads(gradient(ctx, backward, *grads), lists, ctx.lengths))

    body_ = dict(forward=staticmethod(forward), backward=staticmethod(backward_))
    return type(name, (torch.autograd.Function,), body_)


def _flat_grads(grads, lists: Tuple[int, ...], lengths: Tuple[int, ...]) -> list:
    """The gradients of a flattened call: a list input's entries one by one (Nones for a
    None list gradient)."""
    out = []
    for i, g in enumerate(grads):
        if i in lists:
            out.extend([None] * lengths[lists.index(i)] if g is None else g)
        else:
            out.append(g)
    return out


def _function(name: str, forward, backward, setup_context, gradient, lists):
    """The ``autograd.Function`` of a :class:`KernelOp`'s autograd kernel, applied as
    ``(keyset, *inputs)`` or, with tensor-list inputs, ``(keyset, lengths, *flattened
    inputs)``: ``forward(keyset, *inputs)`` redispatches below autograd
    (:func:`_redispatch`)."""
    if not lists:
        def plain_forward(ctx, keyset, *inputs):
            output = forward(keyset, *inputs)
            setup_context(ctx, inputs, output)
            return output

        def plain_backward(ctx, *grads):
            return (None, *gradient(ctx, backward, *grads))

        body = dict(forward=staticmethod(plain_forward), backward=staticmethod(plain_backward))
        return type(name, (torch.autograd.Function,), body)

    def flat_forward(ctx, keyset, lengths, *flat):
        inputs = _unflatten(flat, lists, lengths)
        output = forward(keyset, *inputs)
        ctx.lengths = lengths
        setup_context(ctx, inputs, output)
        return output

    def flat_backward(ctx, *grads):
        # None for the keyset and the lengths
        return (None, None, *_flat_grads(gradient(ctx, backward, *grads), lists, ctx.lengths))

    body = dict(forward=staticmethod(flat_forward), backward=staticmethod(flat_backward))
    return type(name, (torch.autograd.Function,), body)
