"""The ``attnres`` op's PyTorch reference against per-token loops (the kernel's oracle)."""

import pytest
import torch

from depthmix.kernels.attnres import attnres_reference


def loop_attnres(sources, query, key_weight, eps, out_weight=None):
    """One token at a time, straight from a = softmax(w . RMSNorm(v)), out = sum a v."""
    seq, batch, _ = sources[0].shape
    out = torch.zeros_like(sources[0])
    weights = torch.zeros(len(sources), seq, batch, dtype=sources[0].dtype)
    for t in range(seq):
        for n in range(batch):
            keys = [v[t, n] / torch.sqrt((v[t, n] ** 2).mean() + eps) * key_weight for v in sources]
            scores = torch.stack([torch.exp(query @ k) for k in keys])
            a = scores / scores.sum()
            o = sum(a_s * v[t, n] for a_s, v in zip(a, sources))
            if out_weight is not None:
                o = o / torch.sqrt((o ** 2).mean() + eps) * out_weight
            out[t, n] = o
            weights[:, t, n] = a
    return out, weights


def make_inputs(num_sources, seq=5, batch=2, hidden=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = [torch.randn(seq, batch, hidden, generator=g, dtype=dtype) * (1 + s)
               for s in range(num_sources)]
    query = torch.randn(hidden, generator=g, dtype=dtype) * 0.5
    key_weight = 1 + 0.1 * torch.randn(hidden, generator=g, dtype=dtype)
    out_weight = 1 + 0.1 * torch.randn(hidden, generator=g, dtype=dtype)
    return sources, query, key_weight, out_weight


@pytest.mark.parametrize("fused_norm", [False, True], ids=["plain", "fused_out_norm"])
@pytest.mark.parametrize("num_sources", [1, 2, 7])
def test_reference_matches_token_loops_fp64(num_sources, fused_norm):
    sources, query, key_weight, out_weight = make_inputs(num_sources)
    leaves = [t.clone().requires_grad_() for t in (*sources, query, key_weight, out_weight)]
    ow = leaves[-1] if fused_norm else None
    out, w = attnres_reference(leaves[:num_sources], leaves[-3], leaves[-2], 1e-6, out_weight=ow,
                               return_weights=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    fast = torch.autograd.grad((out * grad).sum(), leaves, allow_unused=True)
    ref_out, ref_w = loop_attnres(leaves[:num_sources], leaves[-3], leaves[-2], 1e-6, ow)
    slow = torch.autograd.grad((ref_out * grad).sum(), leaves, allow_unused=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=1e-12)
    for a, b in zip(fast, slow):
        if b is None:
            assert a is None or torch.all(a == 0)
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_single_source_is_passed_through_exactly():
    sources, query, key_weight, _ = make_inputs(1, dtype=torch.bfloat16)
    assert torch.equal(attnres_reference(sources, query, key_weight), sources[0])


def test_low_precision_inputs_keep_fp32_statistics():
    """bf16 in, bf16 out, but the statistics are the fp32 ones of the same inputs: only
    the final rounding of the output differs."""
    sources, query, key_weight, _ = make_inputs(4, dtype=torch.bfloat16)
    out, w = attnres_reference(sources, query, key_weight, return_weights=True)
    up = [s.float() for s in sources]
    ref, ref_w = attnres_reference(up, query.float(), key_weight.float(), return_weights=True)
    assert out.dtype == torch.bfloat16 and w.dtype == torch.float32
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out, ref.bfloat16(), rtol=0, atol=0)


def test_zero_query_gives_uniform_weights():
    sources, _, key_weight, _ = make_inputs(5)
    out, w = attnres_reference(sources, torch.zeros(16, dtype=torch.float64), key_weight,
                               return_weights=True)
    torch.testing.assert_close(w, torch.full_like(w, 0.2))
    torch.testing.assert_close(out, sum(sources) / 5)
