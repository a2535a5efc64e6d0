"""The fused MoDA attention kernel (``moda_attention_fused``, ``mixer.moda_kernel=fused``;
Triton, the interpreter on CPU) against the PyTorch reference: the output and all five
input gradients, fp32 kernel vs the reference in fp64.

Axes: group size G (1, 2, 3 = padded to 4, 4, 8, 16), depth D (0 = causal attention, 1,
several; ``depth_count < D`` on a zero-filled buffer), T = 37 (not a multiple of any tile),
head dims 64/80/128, batch 1 and 3, decoding (``sq < sk``), depth sub-tiles (16 rows) and
the paper's single block-diagonal product (``depth_sub = block_m``), depth steps that
split D. Ids read ``T<sq>[-sk<sk>]-G<G>-hd<hn>-D<D>[c<count>]-B<b>-<tiles>``.
"""

import pytest
import torch

from depthmix.kernels.dispatch import triton_status
from depthmix.kernels.moda_attention import moda_attention_fused, moda_attention_reference
from depthmix.kernels.moda_attention.triton import Tiles, default_tiles
from depthmix.megatron_ext.attention import causal_sdpa

pytestmark = pytest.mark.skipif(not triton_status()[0], reason=triton_status()[1])

F64 = torch.float64
# fp32 kernel vs fp64 reference (randn inputs, O(1) outputs and gradients): measured
# errors are <= 3e-6
TOL = dict(rtol=1e-5, atol=1e-5)


def tiles(block_m, block_n, group, sub=16, block_d=None):
    """Test tiles: the smallest depth step that fills a 16-column sub-tile, unless given."""
    gp = 1 << (group - 1).bit_length()
    sub = max(sub, gp)
    if block_d is None:
        block_d = max(1, 16 // (sub // gp))
    return Tiles(block_m=max(block_m, gp), block_n=block_n, depth_sub=sub, block_d=block_d,
                 dkdv_m=max(block_m, gp), dkdv_n=block_n, num_warps=4, num_stages=1)


def inputs(sq, sk, b, g, ng, hn, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype).requires_grad_()

    q, k, v = r(sq, b, g * ng, hn), r(sk, b, ng, hn), r(sk, b, ng, hn)
    if d is None:
        return q, k, v, None, None
    return q, k, v, r(sq, b, ng, d, hn), r(sq, b, ng, d, hn)


def fwd_bwd(fn, args, grad_out, **kwargs):
    out = fn(*args, **kwargs)
    leaves = [a for a in args if a is not None]
    return out, torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def upcast(args, dtype=F64):
    return [None if a is None else a.detach().to(dtype).requires_grad_() for a in args]


def assert_matches_reference(args, count=None, tol=TOL, tiles_=None, ref_dtype=F64):
    sq, b, np_, hn = args[0].shape
    grad_out = torch.randn(sq, b, np_ * hn, generator=torch.Generator().manual_seed(1),
                           dtype=F64)
    out_ref, g_ref = fwd_bwd(moda_attention_reference, upcast(args, ref_dtype), grad_out,
                             depth_count=count)
    out, grads = fwd_bwd(moda_attention_fused, args, grad_out, depth_count=count,
                         tiles=tiles_)
    assert out.dtype == args[0].dtype and out.shape == out_ref.shape
    torch.testing.assert_close(out.to(F64), out_ref.to(F64), **tol, msg="output")
    for name, a, r in zip(("dq", "dk", "dv", "d_depth_k", "d_depth_v"), grads, g_ref):
        assert a.dtype == args[0].dtype
        torch.testing.assert_close(a.to(F64), r.to(F64), **tol, msg=name)
    return out, grads


# (sq, sk, b, G, ng, hn, D, tiles)
CASES = [
    pytest.param(37, 37, 1, 1, 1, 64, 3, tiles(16, 16, 1), id="T37-G1-hd64-D3-B1-t16"),
    pytest.param(37, 37, 3, 4, 2, 80, 5, tiles(64, 32, 4), id="T37-G4-hd80-D5-B3-t64sub16"),
    pytest.param(37, 37, 1, 2, 1, 128, 1, tiles(32, 16, 2), id="T37-G2-hd128-D1-B1-t32sub16"),
    pytest.param(37, 37, 1, 8, 1, 64, 6, tiles(32, 16, 8, sub=32),
                 id="T37-G8-hd64-D6-B1-t32-blockdiag"),
    pytest.param(37, 37, 3, 3, 1, 64, 4, tiles(32, 16, 3), id="T37-G3pad4-hd64-D4-B3-t32"),
    pytest.param(20, 20, 1, 16, 1, 64, 2, tiles(32, 16, 16), id="T20-G16-hd64-D2-B1"),
    pytest.param(5, 37, 3, 4, 1, 64, 3, tiles(16, 16, 4), id="T5-sk37-G4-hd64-D3-B3-decode"),
    pytest.param(1, 23, 1, 2, 2, 64, 2, tiles(16, 16, 2), id="T1-sk23-G2-hd64-D2-B1-decode"),
]


@pytest.mark.parametrize("sq,sk,b,g,ng,hn,d,tiles_", CASES)
def test_matches_reference_fp32(sq, sk, b, g, ng, hn, d, tiles_):
    assert_matches_reference(inputs(sq, sk, b, g, ng, hn, d), tiles_=tiles_)


@pytest.mark.parametrize("sq,sk", [(37, 37), (4, 37)], ids=["T37", "T4-sk37-decode"])
def test_no_depth_is_causal_attention(sq, sk):
    """D = 0 (the first layer), ``None`` or ``depth_count = 0``: plain causal attention."""
    args = inputs(sq, sk, 1, 4, 1, 64, None)
    t = tiles(32, 16, 4)
    out, _ = assert_matches_reference(args, tiles_=t)
    plain = causal_sdpa(*[a.detach() for a in args[:3]])
    torch.testing.assert_close(out.detach(), plain, **TOL)
    q, k, v, kd, vd = [a.detach() for a in inputs(sq, sk, 1, 4, 1, 64, 3)]
    torch.testing.assert_close(moda_attention_fused(q, k, v, kd, vd, 0, tiles=t),
                               causal_sdpa(q, k, v), **TOL)
    torch.testing.assert_close(moda_attention_fused(q, k, v, kd[:, :, :, :0], vd[:, :, :, :0],
                                                     tiles=t), causal_sdpa(q, k, v), **TOL)


def test_depth_count_on_a_zero_filled_buffer():
    """A preallocated buffer of capacity 6 holding 3 entries: equals attention over the 3
    entries, the tail gets zero gradient, and the tail is never read (NaN there is fine)."""
    q, k, v, kd, vd = inputs(37, 37, 1, 2, 1, 64, 3)
    cap, count, t = 6, 3, tiles(32, 16, 2, block_d=2)
    buf_k = torch.zeros(37, 1, 1, cap, 64)
    buf_v = torch.zeros(37, 1, 1, cap, 64)
    buf_k[:, :, :, :count] = kd.detach()
    buf_v[:, :, :, :count] = vd.detach()
    buf_k.requires_grad_()
    buf_v.requires_grad_()
    exact, _ = assert_matches_reference([q, k, v, kd, vd], tiles_=t)
    out, grads = assert_matches_reference([q, k, v, buf_k, buf_v], count=count, tiles_=t)
    torch.testing.assert_close(out, exact, **TOL)
    for grad in grads[3:]:
        assert grad[:, :, :, count:].abs().max() == 0
    unmasked = moda_attention_fused(q, k, v, buf_k, buf_v, tiles=t)  # zero keys take mass
    assert not torch.allclose(unmasked, exact, **TOL)
    nan_k, nan_v = buf_k.detach().clone(), buf_v.detach().clone()
    nan_k[:, :, :, count:] = float("nan")
    nan_v[:, :, :, count:] = float("nan")
    out_nan = moda_attention_fused(q, k, v, nan_k, nan_v, depth_count=count, tiles=t)
    torch.testing.assert_close(out_nan, exact, **TOL)


def patch_interpreter_bf16_dot(monkeypatch):
    """Triton 3.9's interpreter stores bf16 as raw uint16 bits and its ``create_dot`` feeds
    those bits to ``np.matmul`` (only fp8 is converted), so bf16 ``tl.dot`` is wrong on CPU.
    Convert bf16 operands to fp32 first (exact; the GPU multiplies bf16 exactly into fp32
    too). No effect on GPU runs."""
    if not torch.cuda.is_available():
        import numpy as np
        from triton.runtime import interpreter

        original = interpreter.InterpreterBuilder.create_dot

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            def up(x):
                if x.dtype.scalar == interpreter.tl.bfloat16:
                    bits = x.data.astype(np.uint32) << 16
                    return interpreter.TensorHandle(bits.view(np.float32),
                                                    interpreter.tl.float32)
                return x
            return original(self, up(a), up(b), d, input_precision, max_num_imprecise_acc)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture
def interpreter_bf16_dot(monkeypatch):
    patch_interpreter_bf16_dot(monkeypatch)


@pytest.mark.usefixtures("interpreter_bf16_dot")
def test_bf16_inputs_against_the_fp32_reference():
    """bf16 inputs, fp32 statistics. Compared with the fp32 reference on the same
    (bf16-rounded) inputs; the kernel rounds P and dS to bf16 before the value/key products
    (like flash attention) and its outputs/gradients to bf16. Tolerance: 2e-2 abs+rel on
    O(1) values (measured: max abs error 2.6e-2 on gradients up to 3.4, i.e. <= 1.2% of the
    largest value, about one bf16 ulp there)."""
    args = inputs(37, 37, 1, 4, 2, 64, 5, dtype=torch.bfloat16)
    assert_matches_reference(args, tol=dict(rtol=2e-2, atol=2e-2), tiles_=tiles(32, 16, 4),
                             ref_dtype=torch.float32)


def test_deterministic():
    """No atomics: two runs give bitwise identical outputs and gradients."""
    args = inputs(20, 20, 1, 4, 1, 64, 3)
    grad_out = torch.randn(20, 1, 4 * 64)
    t = tiles(16, 16, 4)
    out1, g1 = fwd_bwd(moda_attention_fused, args, grad_out, tiles=t)
    out2, g2 = fwd_bwd(moda_attention_fused, args, grad_out, tiles=t)
    assert torch.equal(out1, out2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_default_tiles_are_valid():
    """The GPU heuristics give legal tiles (checked by the launcher) for every G and D."""
    from depthmix.kernels.moda_attention.triton import _check_tiles

    for hn in (64, 80, 128, 256):
        for g in (1, 2, 3, 4, 8, 16, 32):
            for d in (1, 5, 95, 256):
                gp = 1 << (g - 1).bit_length()
                t = default_tiles(hn, g, d)
                _check_tiles(t, gp)
                _check_tiles(default_tiles(hn, g, d, sub_tiles=False), gp)


def test_errors():
    q, k, v, kd, vd = [a.detach() for a in inputs(8, 8, 1, 2, 1, 64, 2)]
    with pytest.raises(ValueError, match="depth_key"):
        moda_attention_fused(q, k, v, kd[:4], vd[:4])
    with pytest.raises(ValueError, match="go together"):
        moda_attention_fused(q, k, v, kd, None)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        moda_attention_fused(*[a.double() for a in (q, k, v, kd, vd)])
    big = torch.zeros(8, 1, 2, 320)
    with pytest.raises(ValueError, match="head dims <= 256"):
        moda_attention_fused(big, big[:, :, :1], big[:, :, :1])
    with pytest.raises(ValueError, match="power of two"):
        moda_attention_fused(q, k, v, kd, vd, tiles=Tiles(24, 16, 16, 8, 16, 16))
    with pytest.raises(ValueError, match=">= 16 columns"):
        moda_attention_fused(q, k, v, kd, vd, tiles=Tiles(16, 16, 16, 1, 16, 16))
