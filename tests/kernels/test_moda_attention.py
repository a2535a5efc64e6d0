"""``moda_attention`` reference: against explicit loops, its visibility rule, the
preallocated-buffer (``depth_count``) form the fused kernel uses, decoding, and fp32
statistics for bf16 inputs. (The fused kernel:
``test_moda_attention_triton.py``; the split path: ``test_moda_attention_split.py``.)"""

import math

import pytest
import torch

from depthmix.kernels.moda_attention import moda_attention_reference, moda_depth_weights
from depthmix.megatron_ext.attention import causal_sdpa

F64 = torch.float64

# (sq, sk, b, np, ng, hn, D)
SHAPES = [
    pytest.param(8, 8, 2, 4, 2, 8, 3, id="s8-gqa2-D3"),
    pytest.param(8, 8, 1, 3, 3, 4, 1, id="s8-mha-D1"),
    pytest.param(6, 6, 2, 6, 2, 8, 5, id="s6-gqa3-D5"),
    pytest.param(3, 9, 2, 4, 1, 8, 4, id="decode-sq3-sk9-mqa"),
    pytest.param(1, 7, 1, 4, 2, 4, 2, id="decode-sq1"),
]


def inputs(sq, sk, b, np_, ng, hn, d, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype).requires_grad_()

    q, k, v = r(sq, b, np_, hn), r(sk, b, ng, hn), r(sk, b, ng, hn)
    return q, k, v, r(sq, b, ng, d, hn), r(sq, b, ng, d, hn)


def loop_moda(q, k, v, dk, dv):
    """The MoDA paper Alg. 1 without tiling: per query row, causal keys then its depth entries."""
    sq, b, np_, hn = q.shape
    sk, _, ng, _ = k.shape
    grp = np_ // ng
    out = torch.zeros(sq, b, np_, hn, dtype=q.dtype)
    for n in range(b):
        for h in range(np_):
            kvh = h // grp
            for i in range(sq):
                t = sk - sq + i
                logits = [q[i, n, h] @ k[j, n, kvh] / math.sqrt(hn) for j in range(t + 1)]
                logits += [q[i, n, h] @ dk[i, n, kvh, e] / math.sqrt(hn)
                           for e in range(dk.shape[3])]
                w = torch.softmax(torch.stack(logits), 0)
                o = sum(w[j] * v[j, n, kvh] for j in range(t + 1))
                o = o + sum(w[t + 1 + e] * dv[i, n, kvh, e] for e in range(dk.shape[3]))
                out[i, n, h] = o
    return out.reshape(sq, b, np_ * hn)


@pytest.mark.parametrize("sq,sk,b,np_,ng,hn,d", SHAPES)
def test_reference_matches_loops_fwd_bwd(sq, sk, b, np_, ng, hn, d):
    args = inputs(sq, sk, b, np_, ng, hn, d)
    out = moda_attention_reference(*args)
    ref = loop_moda(*args)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    g_out = torch.autograd.grad(out, args, grad)
    g_ref = torch.autograd.grad(ref, args, grad)
    for name, a, r in zip(("q", "k", "v", "dk", "dv"), g_out, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12, msg=name)


def test_impl_selects_the_reference_or_the_split_path():
    from depthmix.kernels.dispatch import select
    from depthmix.kernels.moda_attention import moda_attention_triton
    from depthmix.kernels.moda_attention.split import moda_attention_triton as split

    assert select("moda_attention", "torch") is moda_attention_reference
    assert select("moda_attention", "triton") is moda_attention_triton is split


def test_visibility_rule():
    """Query t sees causal keys <= t and only its own position's depth entries."""
    q, k, v, dk, dv = [a.detach() for a in inputs(8, 8, 2, 4, 2, 8, 3)]
    out = moda_attention_reference(q, k, v, dk, dv)
    t = 4
    k2, v2, dk2, dv2 = k.clone(), v.clone(), dk.clone(), dv.clone()
    k2[t + 1:] += 5.0
    v2[t + 1:] -= 3.0
    dk2[:t] += 5.0
    dk2[t + 1:] += 5.0
    dv2[:t] -= 3.0
    dv2[t + 1:] -= 3.0
    out2 = moda_attention_reference(q, k2, v2, dk2, dv2)
    torch.testing.assert_close(out2[t], out[t], rtol=0, atol=1e-14)
    assert not torch.allclose(out2[t + 1], out[t + 1])
    dk3 = dk.clone()
    dk3[t, :, :, 1] += 1.0  # its own depth entry matters
    assert not torch.allclose(moda_attention_reference(q, k, v, dk3, dv)[t], out[t])


def test_no_depth_is_causal_attention():
    q, k, v, dk, dv = [a.detach() for a in inputs(8, 8, 2, 4, 2, 8, 3)]
    plain = causal_sdpa(q, k, v)
    torch.testing.assert_close(moda_attention_reference(q, k, v), plain, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(moda_attention_reference(q, k, v, dk, dv, depth_count=0), plain,
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_depth_count_on_a_zero_filled_buffer(count):
    """The fused kernel's form: a preallocated zero buffer of capacity D and a count."""
    q, k, v, dk, dv = inputs(8, 8, 2, 4, 2, 8, 3)
    cap = 6
    buf_k = torch.zeros(8, 2, 2, cap, 8, dtype=F64)
    buf_v = torch.zeros(8, 2, 2, cap, 8, dtype=F64)
    buf_k[:, :, :, :count] = dk[:, :, :, :count]
    buf_v[:, :, :, :count] = dv[:, :, :, :count]
    out = moda_attention_reference(q, k, v, buf_k, buf_v, depth_count=count)
    exact = moda_attention_reference(q, k, v, dk[:, :, :, :count], dv[:, :, :, :count])
    torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-13)
    unmasked = moda_attention_reference(q, k, v, buf_k, buf_v)  # zero keys would take mass
    assert not torch.allclose(unmasked, exact)
    g1 = torch.autograd.grad(out.sum(), (q, k, v))
    g2 = torch.autograd.grad(exact.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_decoding_rows_equal_the_full_computation():
    q, k, v, dk, dv = [a.detach() for a in inputs(9, 9, 2, 4, 2, 8, 3)]
    full = moda_attention_reference(q, k, v, dk, dv)
    last = moda_attention_reference(q[6:], k, v, dk[6:], dv[6:])
    torch.testing.assert_close(last, full[6:], rtol=1e-12, atol=1e-13)


def test_depth_weights_are_the_depth_part_of_the_softmax():
    q, k, v, dk, dv = [a.detach() for a in inputs(8, 8, 2, 4, 2, 8, 3)]
    w = moda_depth_weights(q, k, dk)
    assert w.shape == (8, 2, 4, 3) and w.dtype == torch.float32
    # with all values = 1 on depth and 0 on the sequence, the output is the depth mass
    out = moda_attention_reference(q, k, torch.zeros_like(v), dk, torch.ones_like(dv))
    depth_mass = out.view(8, 2, 4, 8)[..., 0].float()
    torch.testing.assert_close(w.sum(-1), depth_mass, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_use_fp32_statistics(dtype):
    args64 = inputs(16, 16, 2, 4, 2, 16, 8)
    args = [a.detach().to(dtype) for a in args64]
    out = moda_attention_reference(*args)
    assert out.dtype == dtype
    exact = moda_attention_reference(*[a.detach().to(dtype).to(F64) for a in args64])
    # only the final cast rounds: error of one rounding of the output
    torch.testing.assert_close(out.to(F64), exact, rtol=2 ** -7, atol=1e-3)
    # scaling the scores up: fp32 softmax does not overflow where fp16 would
    big = moda_attention_reference(*args, softmax_scale=50.0)
    assert torch.isfinite(big.float()).all()


def test_shape_errors():
    q, k, v, dk, dv = [a.detach() for a in inputs(8, 8, 2, 4, 2, 8, 3)]
    with pytest.raises(ValueError, match="depth_key"):
        moda_attention_reference(q, k, v, dk[:4], dv[:4])
    with pytest.raises(ValueError, match="go together"):
        moda_attention_reference(q, k, v, dk, None)
    with pytest.raises(ValueError, match="keys"):
        moda_attention_reference(q, k[:4], v[:4])
