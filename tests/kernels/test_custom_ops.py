"""The Triton kernels as PyTorch custom ops (``depthmix::*``, ``torch.library``), checked
with ``torch.library.opcheck`` in Triton's interpreter: the schema, that the fake
implementation gives the real outputs' shapes, dtypes and strides, that no output aliases
an input, and that the registered autograd formula (whose backward is the ``*_bwd`` op)
gives the same gradients under AOT dispatch as eagerly. Every option that changes the
outputs is covered: mixed states and mix rules, stacked and listed sources, an output norm,
mHC's variants, MoDA with and without depth entries (and a partly filled depth buffer).
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
    opcheck(_op("mhc_read_fwd"), (x, phi, alpha, bias, variant, 4, 1e-6))
    h_res = None if variant == "identity" else torch.rand(tokens, n, n, requires_grad=True)
    opcheck(_op("mhc_post_res_fwd"), (x, _randn(tokens, h), _randn(tokens, n), h_res))
    opcheck(_op("sinkhorn_fwd"), (_randn(tokens, n, n), 4))


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
    registered = re.findall(r'custom_op\("depthmix::(\w+_fwd)"', function.read_text())
    assert registered, f"{function} registers no depthmix:: forward op"
    assert f"def test_{op}(" in here, f"no test_{op} opchecks kernel op {op!r}"
    for name in registered:
        assert f'_op("{name}")' in here, f"depthmix::{name} is not opchecked"
