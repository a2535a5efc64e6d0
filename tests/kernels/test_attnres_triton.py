"""The fused ``attnres`` Triton kernel against the PyTorch reference (Triton's interpreter
on CPU): the output, the weights and every gradient (each source, the pseudo-query, the
key-norm gain, the output-norm gain), fp32 and bf16, over source counts (1, a few,
Block-like, Full-like), hidden sizes (64, 80, 96, 128), token counts that are not a
multiple of the tile, batch 1 and 3, with and without the fused output norm."""

import pytest
import torch

from depthmix.kernels.attnres import attnres_reference, attnres_triton
from depthmix.kernels.attnres.triton import _tiles

# (sources, seq, batch, hidden): tiles are 32 tokens at d=64 and 16 at d=80/96/128, so
# every seq * batch below leaves a partial last tile (or is smaller than one tile).
CASES = [
    (1, 37, 1, 64),  # one source: passed through, zero query/gain gradient
    (2, 37, 3, 80),
    (3, 23, 1, 128),
    (4, 13, 3, 96),  # Block-like: b0..b2 + the partial sum
    (9, 11, 1, 80),  # Block m=12 at 48 layers: b0..b7 + the partial sum
    (17, 7, 3, 64),  # Full-like: deep in the stack
    (25, 5, 1, 128),  # Full-like
]


BF16_STEP = 2**-7 + 1e-5


def case_id(case):
    s, t, b, d = case
    return f"S{s}-T{t}-B{b}-d{d}"


def make_inputs(num_sources, seq, batch, hidden, dtype=torch.float32, param_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    # sources of different scales so the key norm matters; a query large enough that the
    # softmax is far from uniform and its running max moves up and down over the sources
    sources = [(torch.randn(seq, batch, hidden, generator=g) * (0.5 + s % 4)).to(dtype)
               for s in range(num_sources)]
    pd = param_dtype or dtype
    query = (torch.randn(hidden, generator=g) * 0.4).to(pd)
    key_weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(pd)
    out_weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(pd)
    grad = torch.randn(seq, batch, hidden, generator=g).to(dtype)
    return sources, query, key_weight, out_weight, grad


def run(fn, sources, query, key_weight, out_weight, grad, norm, upcast=False):
    """Output, weights and the gradients of every leaf (sources, query, key gain[, out gain])."""
    leaves = [t.detach().clone().requires_grad_() for t in (*sources, query, key_weight, out_weight)]
    used = leaves if norm else leaves[:-1]
    args = [t.float() if upcast else t for t in leaves]
    out, weights = fn(args[:len(sources)], args[-3], args[-2], 1e-6,
                      out_weight=args[-1] if norm else None, return_weights=True)
    out.backward(grad.to(out.dtype))
    return out, weights, [t.grad for t in used]


def assert_ratio(actual, expected, ratio, what):
    """max |actual - expected| <= ratio * max |expected| (exact zeros must stay tiny)."""
    err = (actual.double() - expected.double()).abs().max().item()
    base = expected.double().abs().max().item()
    assert err <= ratio * base + 1e-12, f"{what}: max err {err:.3e}, max |ref| {base:.3e}"


def names(num_sources, norm):
    return [f"d source {s}" for s in range(num_sources)] + ["d query", "d key_weight"] + (
        ["d out_weight"] if norm else [])


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "out_norm"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fp32_matches_reference(case, norm):
    sources, query, key_weight, out_weight, grad = make_inputs(*case)
    out, w, grads = run(attnres_triton, sources, query, key_weight, out_weight, grad, norm)
    ref_out, ref_w, ref_grads = run(attnres_reference, sources, query, key_weight, out_weight,
                                    grad, norm)
    assert out.dtype == torch.float32 and w.shape == ref_w.shape == (case[0], case[1], case[2])
    assert_ratio(out, ref_out, 1e-5, "out")
    assert_ratio(w, ref_w, 1e-5, "weights")
    for name, a, b in zip(names(case[0], norm), grads, ref_grads):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_ratio(a, b, 2e-5, name)
    if case[0] == 1:  # a softmax over one source: weight 1, output = source, no query grad
        assert torch.all(w == 1) and torch.all(grads[1] == 0) and torch.all(grads[2] == 0)
        if not norm:
            assert torch.equal(out, sources[0])


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32_params",
                                                                              "bf16_params"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "out_norm"])
@pytest.mark.parametrize("case", [(5, 37, 3, 96), (13, 9, 1, 128)], ids=case_id)
def test_bf16_inputs_match_fp32_reference(case, norm, param_dtype):
    """bf16 sources (and bf16 or fp32 parameters) vs the fp32 reference on the same values.

    The kernel's statistics are fp32, so the only bf16 error is the final rounding of what
    it writes in bf16: the output and the source gradients are within one bf16 step of
    the fp32 values, ``BF16_STEP = 2^-7 + 1e-5`` of the largest magnitude (a GPU rounds
    to nearest, half a step; Triton's interpreter converts toward zero, up to one step;
    1e-5 for the fp32 arithmetic). The weights are fp32 (1e-5); the query/gain gradients
    are fp32 sums rounded to the parameter dtype (1e-4 for fp32 parameters, one step for
    bf16)."""
    sources, query, key_weight, out_weight, grad = make_inputs(
        *case, dtype=torch.bfloat16, param_dtype=param_dtype)
    out, w, grads = run(attnres_triton, sources, query, key_weight, out_weight, grad, norm)
    ref_out, ref_w, ref_grads = run(attnres_reference, sources, query, key_weight, out_weight,
                                    grad, norm, upcast=True)
    assert out.dtype == torch.bfloat16 and w.dtype == torch.float32
    assert_ratio(out, ref_out, BF16_STEP, "out")
    assert_ratio(w, ref_w, 1e-5, "weights")
    param_tol = 1e-4 if param_dtype == torch.float32 else BF16_STEP
    for i, (name, a, b) in enumerate(zip(names(case[0], norm), grads, ref_grads)):
        is_param = i >= case[0]
        assert a.dtype == (param_dtype if is_param else torch.bfloat16), name
        assert_ratio(a, b, param_tol if is_param else BF16_STEP, name)


def test_fp64_inputs_compute_in_fp64():
    sources, query, key_weight, out_weight, grad = make_inputs(6, 11, 3, 80, dtype=torch.float64)
    out, w, grads = run(attnres_triton, sources, query, key_weight, out_weight, grad, True)
    ref_out, ref_w, ref_grads = run(attnres_reference, sources, query, key_weight, out_weight,
                                    grad, True)
    assert w.dtype == torch.float64
    assert_ratio(out, ref_out, 1e-12, "out")
    assert_ratio(w, ref_w, 1e-12, "weights")
    for name, a, b in zip(names(6, True), grads, ref_grads):
        assert_ratio(a, b, 1e-11, name)


def test_sources_are_never_stacked(monkeypatch):
    """The kernel reads the list through its pointer table: no stack/cat on the way."""
    sources, query, key_weight, out_weight, grad = make_inputs(4, 9, 1, 64)
    leaves = [s.requires_grad_() for s in sources]

    def refuse(*args, **kwargs):
        raise AssertionError("sources were stacked/concatenated")

    monkeypatch.setattr(torch, "stack", refuse)
    monkeypatch.setattr(torch, "cat", refuse)
    out = attnres_triton(leaves, query, key_weight, out_weight=out_weight)
    out.backward(grad)
    assert all(s.grad is not None for s in leaves)


def test_backward_saves_only_per_token_statistics():
    """Besides references to its inputs, autograd keeps O(S * T) fp32 scalars, never a
    [S, T, d] stack or a [T, d] activation."""
    num_sources, seq, batch, hidden = 5, 13, 3, 64
    sources, query, key_weight, out_weight, _ = make_inputs(num_sources, seq, batch, hidden)
    leaves = [t.requires_grad_() for t in (*sources, query, key_weight, out_weight)]
    inputs = {t.data_ptr() for t in leaves}
    extra = []

    def pack(t):
        if t.data_ptr() not in inputs:
            extra.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attnres_triton(leaves[:num_sources], *leaves[num_sources:-1], out_weight=leaves[-1])
    tokens = seq * batch
    assert extra and sum(t.numel() for t in extra) <= (2 * num_sources + 1) * tokens
    assert all(t.dtype == torch.float32 and t.shape[-1] == tokens for t in extra)


def test_backward_is_deterministic():
    sources, query, key_weight, out_weight, grad = make_inputs(7, 37, 3, 64)
    first = run(attnres_triton, sources, query, key_weight, out_weight, grad, True)[2]
    second = run(attnres_triton, sources, query, key_weight, out_weight, grad, True)[2]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_mismatched_sources_are_refused():
    sources, query, key_weight, _, _ = make_inputs(2, 5, 1, 64)
    with pytest.raises(ValueError, match="source 1"):
        attnres_triton([sources[0], sources[1][:4]], query, key_weight)
    with pytest.raises(ValueError, match="at least one source"):
        attnres_triton([], query, key_weight)


def test_tiles_cover_any_hidden_size():
    for d in (64, 80, 96, 128, 1536, 2048, 5120):
        bt, bd, warps = _tiles(d)
        assert bd >= d and bd < 2 * d and bt * bd >= min(2048, bd) and 1 <= warps <= 16
