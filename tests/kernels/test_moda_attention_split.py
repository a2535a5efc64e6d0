"""The split MoDA path (``moda_attention_triton``, ``mixer.moda_kernel=split``): the sequence
part through SDPA's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward: the same output / log-sum-exp contract as the CUDA flash and cuDNN ops),
the depth part through the Triton depth kernels (the interpreter), merged by log-sum-exp.

* The depth kernels alone against a plain fp64 merge / backward formula, on sequence
  outputs and log-sum-exps laid out as the attention ops return them.
* The whole path against the reference, output and all five input gradients, fp32 vs
  fp64: G 1/2/3 (padded to 4)/4, D 1..5, T = 37 (no multiple of a tile), a partly filled
  depth buffer (``depth_count``, what ``depth_window`` keeps), batch 2, head dim 80.
* No depth entries: causal SDPA; decoding: the fused kernel; bf16 inputs.
* ``torch.compile`` (AOT autograd, ``fullgraph``): no graph break, eager's numbers; the
  depth custom ops pass ``opcheck``.
"""

import dataclasses

import pytest
import torch
from torch.library import opcheck

from depthmix.kernels.dispatch import triton_status
from depthmix.kernels.moda_attention import moda_attention_reference

pytestmark = pytest.mark.skipif(not triton_status()[0], reason=triton_status()[1])

F64 = torch.float64
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 path vs fp64 reference: measured <= 1.1e-6


def inputs(sq, sk, b, g, ng, hn, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype).requires_grad_()

    q, k, v = r(sq, b, g * ng, hn), r(sk, b, ng, hn), r(sk, b, ng, hn)
    return q, k, v, r(sq, b, ng, d, hn), r(sq, b, ng, d, hn)


def grads_of(fn, args, grad_out, **kwargs):
    out = fn(*args, **kwargs)
    return out, torch.autograd.grad(out, args, grad_out.to(out.dtype))


def assert_matches_reference(args, count=None, tol=TOL, ref_dtype=F64):
    from depthmix.kernels.moda_attention import moda_attention_triton

    sq, b, np_, hn = args[0].shape
    grad_out = torch.randn(sq, b, np_ * hn, generator=torch.Generator().manual_seed(1),
                           dtype=F64)
    up = [a.detach().to(ref_dtype).requires_grad_() for a in args]
    out_ref, g_ref = grads_of(moda_attention_reference, up, grad_out, depth_count=count)
    out, grads = grads_of(moda_attention_triton, args, grad_out, depth_count=count)
    assert out.dtype == args[0].dtype and out.shape == out_ref.shape
    torch.testing.assert_close(out.to(F64), out_ref.to(F64), **tol, msg="output")
    for name, a, r in zip(("dq", "dk", "dv", "d_depth_k", "d_depth_v"), grads, g_ref):
        assert a.dtype == args[0].dtype and a.shape == r.shape, name
        torch.testing.assert_close(a.to(F64), r.to(F64), **tol, msg=name)
    return out, grads


# (sq, b, G, ng, hn, D)
CASES = [
    pytest.param(37, 1, 1, 2, 64, 3, id="T37-G1-hd64-D3"),
    pytest.param(37, 2, 2, 1, 32, 1, id="T37-G2-hd32-D1-B2"),
    pytest.param(37, 1, 4, 2, 64, 5, id="T37-G4-hd64-D5"),
    pytest.param(23, 2, 3, 1, 80, 2, id="T23-G3pad4-hd80-D2-B2"),
    pytest.param(20, 1, 4, 1, 64, 4, id="T20-G4-hd64-D4"),
]


@pytest.mark.parametrize("sq,b,g,ng,hn,d", CASES)
def test_matches_reference_fp32(sq, b, g, ng, hn, d):
    assert_matches_reference(inputs(sq, sq, b, g, ng, hn, d))


def test_partly_filled_depth_buffer():
    """``depth_count`` of a zero-filled buffer of capacity 5 holding 2 entries (a window):
    the reference's result, zero gradient beyond the count, and the tail never read."""
    q, k, v, kd, vd = inputs(19, 19, 1, 2, 2, 64, 5)
    _, grads = assert_matches_reference([q, k, v, kd, vd], count=2)
    for grad in grads[3:]:
        assert grad[:, :, :, 2:].abs().max() == 0
    from depthmix.kernels.moda_attention import moda_attention_triton

    nan_k, nan_v = kd.detach().clone(), vd.detach().clone()
    nan_k[:, :, :, 2:] = float("nan")
    nan_v[:, :, :, 2:] = float("nan")
    exact = moda_attention_reference(q.detach(), k.detach(), v.detach(), kd[:, :, :, :2].detach(),
                                     vd[:, :, :, :2].detach())
    torch.testing.assert_close(moda_attention_triton(q, k, v, nan_k, nan_v, depth_count=2),
                               exact, **TOL)


def test_no_depth_is_causal_attention_and_decoding_takes_the_fused_kernel():
    from depthmix.kernels.moda_attention import moda_attention_triton
    from depthmix.megatron_ext.attention import causal_sdpa

    q, k, v, kd, vd = [a.detach() for a in inputs(21, 21, 1, 2, 2, 32, 3)]
    plain = causal_sdpa(q, k, v)
    torch.testing.assert_close(moda_attention_triton(q, k, v), plain, **TOL)
    torch.testing.assert_close(moda_attention_triton(q, k, v, kd, vd, depth_count=0), plain,
                               **TOL)
    assert_matches_reference(inputs(4, 21, 1, 2, 2, 32, 3))  # sq < sk: the fused kernel


# ---- the depth kernels alone --------------------------------------------------------------


def _depth_reference(q, kd, vd, o_seq, lse_seq, count, scale):
    """fp64: the joint output and log-sum-exp of the sequence block ``(o_seq, lse_seq)``
    ([b, np, sq, ...]) and the first ``count`` depth entries of each row."""
    sq, b, np_, hn = q.shape
    ng = kd.shape[2]
    q5 = q.double().view(sq, b, ng, np_ // ng, hn)
    s = torch.einsum("sbngh,sbndh->sbngd", q5, kd[:, :, :, :count].double()) * scale
    lse_s = lse_seq.double().permute(2, 0, 1).reshape(sq, b, ng, -1)
    lse = torch.logaddexp(lse_s, torch.logsumexp(s, -1))
    o_s = o_seq.double().permute(2, 0, 1, 3).reshape(sq, b, ng, -1, hn)
    o = o_s * torch.exp(lse_s - lse)[..., None] + torch.einsum(
        "sbngd,sbndh->sbngh", torch.exp(s - lse[..., None]), vd[:, :, :, :count].double())
    return o.reshape(sq, b, np_, hn), lse, s


@pytest.mark.parametrize("g,d,count", [(1, 4, 4), (2, 5, 3), (3, 1, 1), (4, 3, 3)],
                         ids=["G1-D4", "G2-D5c3", "G3pad4-D1", "G4-D3"])
def test_depth_kernels_against_the_merge_formula(g, d, count):
    from depthmix.kernels.moda_attention.triton import (
        default_depth_tiles,
        moda_depth_bwd,
        moda_depth_fwd,
    )

    sq, b, ng, hn = 13, 2, 1, 48
    gen = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, kd, vd = r(sq, b, g * ng, hn), r(sq, b, ng, d, hn), r(sq, b, ng, d, hn)
    # as the CPU flash op lays them out: o [b, h, s, d] over [b, s, h, d] memory, lse likewise
    o_seq = r(b, sq, g * ng, hn).transpose(1, 2)
    lse_seq = (3 * r(b, sq, g * ng)).transpose(1, 2)
    scale, tiles = hn ** -0.5, default_depth_tiles(hn, g, d)
    o, lse = moda_depth_fwd(q, kd, vd, o_seq, lse_seq, count, scale, tiles)
    o_ref, lse_ref, s = _depth_reference(q, kd, vd, o_seq, lse_seq, count, scale)
    assert o.is_contiguous() and lse.stride() == lse_seq.stride()
    torch.testing.assert_close(o.double(), o_ref, **TOL)
    torch.testing.assert_close(lse.double().permute(2, 0, 1), lse_ref.reshape(sq, b, -1), **TOL)

    do, dq_seq = r(sq, b, g * ng, hn), r(b, g * ng, sq, hn)
    dq, dkd, dvd = moda_depth_bwd(do, q, kd, vd, o, lse, dq_seq, count, scale, tiles)
    # the depth entries' share of the joint softmax, with delta = rowsum(dO o)
    p = torch.exp(s - lse_ref[..., None])  # [sq, b, ng, G, count]
    do5, o5 = do.double().view(sq, b, ng, g, hn), o.double().view(sq, b, ng, g, hn)
    dp = torch.einsum("sbngh,sbndh->sbngd", do5, vd[:, :, :, :count].double())
    ds = p * (dp - (do5 * o5).sum(-1, keepdim=True))
    dq_ref = dq_seq.double().permute(2, 0, 1, 3) + scale * torch.einsum(
        "sbngd,sbndh->sbngh", ds, kd[:, :, :, :count].double()).reshape(sq, b, -1, hn)
    q5 = q.double().view(sq, b, ng, g, hn)
    torch.testing.assert_close(dq.double(), dq_ref, **TOL)
    torch.testing.assert_close(dkd[:, :, :, :count].double(),
                               scale * torch.einsum("sbngd,sbngh->sbndh", ds, q5), **TOL)
    torch.testing.assert_close(dvd[:, :, :, :count].double(),
                               torch.einsum("sbngd,sbngh->sbndh", p, do5), **TOL)
    assert dkd[:, :, :, count:].abs().sum() == dvd[:, :, :, count:].abs().sum() == 0


def test_bf16_inputs_against_the_fp32_reference(interpreter_bf16_dot):
    """bf16 inputs, fp32 statistics: the sequence output is rounded to bf16 by the attention
    op before the merge and the joint output again after it (what ring attention does),
    so the tolerance is the fused kernel's bf16 one (2e-2 on O(1) values)."""
    args = inputs(37, 37, 1, 4, 2, 64, 5, dtype=torch.bfloat16)
    assert_matches_reference(args, tol=dict(rtol=2e-2, atol=2e-2), ref_dtype=torch.float32)


# ---- torch.compile and the custom ops -----------------------------------------------------


def test_compiles_without_graph_breaks():
    """AOT autograd over the split path with ``fullgraph=True`` (a break would raise): the
    depth kernels as custom ops (their fake implementations give the shapes), the CPU flash
    op and its backward traced as they are; eager's output and gradients."""
    from depthmix.kernels.moda_attention import moda_attention_triton

    torch._dynamo.reset()
    args = inputs(21, 21, 1, 2, 2, 32, 3)
    grad_out = torch.randn(21, 1, 4 * 32, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(moda_attention_triton, backend="aot_eager", fullgraph=True)
    out_eager, g_eager = grads_of(moda_attention_triton, args, grad_out)
    out, grads = grads_of(compiled, args, grad_out)
    torch.testing.assert_close(out, out_eager, rtol=1e-6, atol=1e-6)
    for a, e in zip(grads, g_eager):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


def test_depth_custom_ops_opcheck():
    from depthmix.kernels.moda_attention import moda_attention_triton  # noqa: F401 (registers)
    from depthmix.kernels.moda_attention.triton import default_depth_tiles

    sq, b, ng, g, hn, d = 6, 1, 1, 2, 16, 3
    r = torch.randn
    q, kd, vd = r(sq, b, ng * g, hn), r(sq, b, ng, d, hn), r(sq, b, ng, d, hn)
    o_seq, lse_seq = r(b, sq, ng * g, hn).transpose(1, 2), r(b, sq, ng * g).transpose(1, 2)
    tiles = list(dataclasses.astuple(default_depth_tiles(hn, g, d)))
    ops = torch.ops.depthmix
    opcheck(ops.moda_depth_fwd.default, (q, kd, vd, o_seq, lse_seq, 2, 0.25, tiles))
    o, lse = ops.moda_depth_fwd(q, kd, vd, o_seq, lse_seq, 2, 0.25, tiles)
    opcheck(ops.moda_depth_bwd.default,
            (r(sq, b, ng * g, hn), q, kd, vd, o, lse, r(b, ng * g, sq, hn), 2, 0.25, tiles))


def test_errors():
    from depthmix.kernels.moda_attention import moda_attention_triton
    from depthmix.kernels.moda_attention.triton import DepthTiles

    q, k, v, kd, vd = [a.detach() for a in inputs(8, 8, 1, 2, 1, 64, 2)]
    with pytest.raises(ValueError, match="depth_key"):
        moda_attention_triton(q, k, v, kd[:4], vd[:4])
    with pytest.raises(ValueError, match="go together"):
        moda_attention_triton(q, k, v, kd, None)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        moda_attention_triton(*[a.double() for a in (q, k, v, kd, vd)])
    with pytest.raises(ValueError, match="power of two"):
        moda_attention_triton(q, k, v, kd, vd, tiles=DepthTiles(24, 16, 8))
    with pytest.raises(ValueError, match=">= 16 columns"):
        moda_attention_triton(q, k, v, kd, vd, tiles=DepthTiles(16, 16, 1))


def test_default_depth_tiles_are_valid():
    from depthmix.kernels.moda_attention.triton import _check_depth_tiles, default_depth_tiles

    for hn in (64, 80, 128, 256):
        for g in (1, 2, 3, 4, 8, 16, 32):
            for d in (1, 5, 48, 256):
                _check_depth_tiles(default_depth_tiles(hn, g, d), 1 << (g - 1).bit_length())


@pytest.fixture
def interpreter_bf16_dot(monkeypatch):
    """bf16 ``tl.dot`` in Triton 3.9's interpreter (``test_moda_attention_triton.py``)."""
    from test_moda_attention_triton import patch_interpreter_bf16_dot

    patch_interpreter_bf16_dot(monkeypatch)
