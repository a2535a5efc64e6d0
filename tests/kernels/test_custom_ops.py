"""The Triton kernels as PyTorch custom ops (``depthmix::*``, ``torch.library``), checked
with ``torch.library.opcheck`` in Triton's interpreter: the schema, that the fake
implementation gives the real outputs' shapes, dtypes and strides, that no output aliases
an input, and that the registered autograd formula (whose backward is the ``*_bwd`` op)
gives the same gradients under AOT dispatch as eagerly. Every option that changes the
outputs is covered: mixed states and mix rules, stacked and listed sources, an output norm,
mHC's variants (and its read with the sublayer's input norm), MoDA with and without depth
entries (and a partly filled depth buffer).
What compilation does with them is ``tests/pretrain/test_compile.py``."""

import dataclasses
import pathlib
import re

import pytest
import torch
from torch.library import opcheck

from depthmix import kernels
from depthmix.kernels.dispatch import select


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def _op(name):
    return getattr(torch.ops.depthmix, name).default


@pytest.mark.parametrize("softmax,mix_keys,mix_values,stacked", [
    (True, False, True, False), (True, True, True, True), (False, True, False, False),
    (False, False, True, True)], ids=["softmax-value", "softmax-key_value-stacked",
                                     "uniform-key", "uniform-value-stacked"])
def test_depth_mix(softmax, mix_keys, mix_values, stacked):
    select("depth_mix", "triton")
    s, b, ng, g, hn, n = 5, 2, 2, 2, 16, 3
    q, k, v = _randn(s, b, ng * g, hn), _randn(s, b, ng, hn), _randn(s, b, ng, hn)

    def sources():
        return [_randn(n, s, b, ng, hn)] if stacked else [_randn(s, b, ng, hn) for _ in range(n)]

    keys = sources() if softmax or mix_keys else []
    values = sources() if mix_values else []
    opcheck(_op("depth_mix_fwd"),
            (q, k, v, keys, values, stacked and bool(keys), stacked and bool(values), softmax,
             mix_keys, mix_values, 0.25))


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "out-norm"])
def test_attnres(norm):
    select("attnres", "triton")
    d = 32
    sources = [_randn(6, 2, d) for _ in range(3)]
    out_weight = _randn(d) if norm else None
    opcheck(_op("attnres_fwd"), (sources, _randn(d), _randn(d), out_weight, 1e-6, 1e-5))


@pytest.mark.parametrize("variant", ["mhc", "identity"])
def test_mhc(variant):
    from depthmix.mixers.mhc import coefficient_width

    select("mhc", "triton")
    tokens, n, h = 7, 4, 32
    m = coefficient_width(variant, n)
    x = _randn(tokens, n, h)
    phi, bias = (0.1 * torch.randn(n * h, m)).requires_grad_(), _randn(m)
    alpha = torch.rand(2 if variant == "identity" else 3, requires_grad=True)
    # identity: with the sublayer's input RMSNorm (a norm weight and its epsilon)
    norm = (_randn(h), 1e-5) if variant == "identity" else ()
    opcheck(_op("mhc_read_fwd"), (x, phi, alpha, bias, variant, 4, 1e-6, *norm))
    h_res = None if variant == "identity" else torch.rand(tokens, n, n, requires_grad=True)
    opcheck(_op("mhc_post_res_fwd"), (x, _randn(tokens, h), _randn(tokens, n), h_res))
    opcheck(_op("sinkhorn_fwd"), (_randn(tokens, n, n), 4))


def test_ddl():
    select("ddl", "triton")
    s, b, h, dv = 5, 2, 24, 3
    x, y, x_in = _randn(s, b, h, dv), _randn(s, b, h), _randn(s, b, h)
    opcheck(_op("ddl_read_fwd"), (x, _randn(dv)))
    opcheck(_op("ddl_write_fwd"), (x, y, x_in, _randn(h), _randn(1), _randn(dv, h), _randn(dv),
                                   4.0, 1e-6))


@pytest.mark.parametrize("depth,count", [(0, 0), (3, 3), (4, 2)],
                         ids=["no-depth", "full-depth", "partly-filled"])
def test_moda_attention(depth, count):
    from depthmix.kernels.moda_attention.triton import default_tiles

    select("moda_attention", "triton")
    sq, b, np_, ng, hn = 16, 1, 4, 2, 16
    q, k, v = _randn(sq, b, np_, hn), _randn(sq, b, ng, hn), _randn(sq, b, ng, hn)
    kd, vd = (_randn(sq, b, ng, depth, hn), _randn(sq, b, ng, depth, hn)) if depth else (None,) * 2
    tiles = list(dataclasses.astuple(default_tiles(hn, np_ // ng, depth)))
    opcheck(_op("moda_attention_fwd"), (q, k, v, kd, vd, count, 0.25, tiles))


@pytest.mark.parametrize("op", kernels.ops())
def test_every_op_has_its_forward_custom_ops_checked_here(op):
    """Each ``depthmix::<x>_fwd`` an op's ``function.py`` registers is opchecked above (its
    ``_bwd`` is the registered backward), in a test named ``test_<op>``."""
    here = pathlib.Path(__file__).read_text()
    function = pathlib.Path(kernels.__file__).parent / op / "function.py"
    text = function.read_text()
    registered = re.findall(r'custom_op\("depthmix::(\w+_fwd)"', text) + [
        f"{name}_fwd" for name in re.findall(r'KernelOp\("depthmix::(\w+)"', text)]
    assert registered, f"{function} registers no depthmix:: forward op"
    assert f"def test_{op}(" in here, f"no test_{op} opchecks kernel op {op!r}"
    for name in registered:
        assert f'_op("{name}")' in here, f"depthmix::{name} is not opchecked"


# ---- eager calls: the autograd.Function entry of each KernelOp, against the custom op ----
def _depth_mix_case(stacked):
    from depthmix.kernels.depth_mix.function import depth_mix_triton

    q, k, v = _randn(5, 2, 4, 16), _randn(5, 2, 2, 16), _randn(5, 2, 2, 16)
    src = [_randn(3, 5, 2, 2, 16)] if stacked else [_randn(5, 2, 2, 16) for _ in range(3)]
    keys = src[0] if stacked else src
    values = _randn(3, 5, 2, 2, 16) if stacked else [_randn(5, 2, 2, 16) for _ in range(3)]
    inputs = [q, k, v, *src, *([values] if stacked else values)]
    return inputs, lambda: depth_mix_triton(q, k, v, keys, values, mixed_state="key_value")


def _attnres_case(norm):
    from depthmix.kernels.attnres.function import attnres_triton

    sources = [_randn(6, 2, 32) for _ in range(3)]
    w, g, h = _randn(32), _randn(32), _randn(32) if norm else None
    inputs = [*sources, w, g] + ([h] if norm else [])
    return inputs, lambda: (attnres_triton(sources, w, g, out_weight=h),)


def _mhc_case(variant):
    from depthmix.kernels.mhc.function import mhc_post_res_triton, mhc_read_triton
    from depthmix.mixers.mhc import coefficient_width

    n, h = 4, 32
    m = coefficient_width(variant, n)
    x, y = _randn(3, 2, n, h), _randn(3, 2, h)
    phi, bias = (0.1 * torch.randn(n * h, m)).requires_grad_(), _randn(m)
    alpha = torch.rand(2 if variant == "identity" else 3, requires_grad=True)
    norm = [_randn(h)] if variant == "identity" else []  # identity: with the input norm

    def run():
        x_in, h_pre, h_post, h_res = mhc_read_triton(x, phi, alpha, bias, variant, 4, 1e-6,
                                                     *norm)
        return x_in, h_pre, mhc_post_res_triton(x, y * x_in, h_post, h_res)

    return [x, y, phi, alpha, bias, *norm], run


def _sinkhorn_case(_):
    from depthmix.kernels.mhc.function import sinkhorn_triton

    logits = _randn(2, 3, 4, 4)
    return [logits], lambda: (sinkhorn_triton(logits, 5),)


def _ddl_case(_):
    from depthmix.kernels.ddl.function import ddl_read_triton, ddl_write_triton

    x, y, r = _randn(3, 2, 24, 3), _randn(3, 2, 24), _randn(3)
    params = [_randn(24), _randn(1), _randn(3, 24), _randn(3)]

    def run():
        x_in = ddl_read_triton(x, r)
        return x_in, ddl_write_triton(x, y * x_in, x_in, *params, 4.0, 1e-6)[0]

    return [x, y, r, *params], run


def _backward_nodes(outputs, depth: int = 3) -> str:
    """The names of the autograd nodes up to ``depth`` steps back from ``outputs``."""
    nodes, names = [o.grad_fn for o in outputs], []
    for _ in range(depth):
        nodes = [n for n in nodes if n is not None]
        names += [type(n).__name__ for n in nodes]
        nodes = [m for n in nodes for m, _ in n.next_functions]
    return " ".join(names)


@pytest.mark.parametrize("case,option", [
    (_depth_mix_case, False), (_depth_mix_case, True), (_attnres_case, False),
    (_attnres_case, True), (_mhc_case, "mhc"), (_mhc_case, "identity"), (_sinkhorn_case, None),
    (_ddl_case, None)],
    ids=["depth_mix", "depth_mix-stacked", "attnres", "attnres-out-norm", "mhc", "mhc-identity",
         "sinkhorn", "ddl"])
def test_eager_function_matches_custom_op(case, option):
    """Eager calls run the launchers through a plain autograd.Function (cheaper on the host);
    its outputs and gradients are the custom op's, bit for bit (the same launchers)."""
    from depthmix.kernels._common import custom_ops_in_eager

    for op in ("depth_mix", "attnres", "mhc", "ddl"):
        select(op, "triton")
    torch.manual_seed(0)
    inputs, run = case(option)

    def outputs_and_grads():
        outs = run()
        weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i))
                   for i, o in enumerate(outs)]
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), inputs)
        return outs, grads

    outs, grads = outputs_and_grads()
    nodes = _backward_nodes(outs)
    assert "_function" in nodes and "_op_autograd" not in nodes
    with custom_ops_in_eager():
        op_outs, op_grads = outputs_and_grads()
    assert "_op_autograd" in _backward_nodes(op_outs)
    for a, b in zip((*outs, *grads), (*op_outs, *op_grads)):
        assert torch.equal(a, b)
