"""The fused mHC Triton kernels (``depthmix.kernels.mhc``) vs the PyTorch reference, in
Triton's interpreter on CPU (``tests/conftest.py`` sets TRITON_INTERPRET=1 without CUDA).

* Sinkhorn-Knopp: forward and backward vs the reference (fp32), vs finite differences
  (fp64 gradcheck), doubly stochastic within 1e-3, finite for huge logits.
* Launch 1 (``mhc_read_triton``) and launch 2 (``mhc_post_res_triton``): every output and
  every input gradient vs the reference, fp32 kernels vs the reference evaluated in fp64 on
  the same inputs, max error <= 2e-6 of the tensor's max (measured <= 4e-7); ids
  ``<variant>-n<streams>-h<hidden>-s<seq>-b<batch>``, tokens ``s*b`` never a multiple of the
  16-token tile.
* bf16 activations (x, y) with fp32 parameters vs the fp32/fp64 reference on the same
  (bf16-representable) values: the fp32 coefficients and parameter gradients to 1e-5 of the
  max (they are computed in fp32; measured <= 4e-7); the bf16 outputs ``x_in``, ``X'`` and
  activation gradients to 1.5e-2 of the max (bf16 rounding of the result; measured <= 7e-3).
* The whole tiny model with ``mixer.impl=triton`` vs ``impl=torch`` in fp64 (logits and
  every parameter gradient to 1e-10), and bit-identical repeated backward (determinism).
"""

import pytest
import torch

from depthmix.mixers.mhc import coefficient_width
from depthmix.kernels.mhc import (
    mhc_post_res_triton,
    mhc_read_triton,
    sinkhorn_triton,
    mhc_post_res_reference,
    mhc_read_reference,
    sinkhorn_reference,
)

FP32_TOL = 2e-6
BF16_COEF_TOL = 1e-5
BF16_ACT_TOL = 1.5e-2

# (variant, streams, hidden, seq, batch): streams 1/2/4 (+8), hidden 64/80/128/96, batch 1
# and 3, tokens 37, 39, 21, 13, 11, 5 (the tile is 16). Sinkhorn runs the default 20
# iterations in the first case and 4 elsewhere (the interpreter pays ~K^2/2 iterations per
# tile in the backward).
CASES = [
    ("mhc", 4, 64, 37, 1),
    ("mhc", 2, 80, 13, 3),
    ("mhc", 1, 128, 7, 3),
    ("mhc", 4, 96, 13, 3),
    ("mhc", 8, 64, 11, 1),
    ("hc", 4, 80, 37, 1),
    ("hc", 2, 128, 13, 3),
    ("hc", 1, 96, 21, 1),
    ("identity", 4, 128, 13, 3),
    ("identity", 2, 96, 37, 1),
    ("identity", 1, 64, 5, 1),
]


def case_id(case):
    variant, n, h, s, b = case
    return f"{variant}-n{n}-h{h}-s{s}-b{b}"


def assert_close(name, ours, ref, tol):
    """Max error relative to the reference's largest entry (a ratio tolerance)."""
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = (ours.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert err <= tol * scale, f"{name}: max err {err:.3e} > {tol:.0e} x {scale:.3e}"


def make_inputs(variant, n, h, s, b, x_dtype=torch.float32, seed=0):
    """Streams, mixing parameters moved well away from the init (every term matters), and
    a sublayer output; all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    m = coefficient_width(variant, n)
    x = torch.randn(s, b, n, h, generator=g).to(x_dtype)
    phi = torch.randn(n * h, m, generator=g) * 0.05
    alpha = torch.rand(2 if variant == "identity" else 3, generator=g) + 0.5
    bias = torch.randn(m, generator=g)
    if variant == "mhc":  # near the paper's 6I - 3, where Sinkhorn converges slowly
        bias[2 * n:] += (6 * torch.eye(n) - 3).flatten()
    y = torch.randn(s, b, h, generator=g).to(x_dtype)
    return [t.requires_grad_() for t in (x, phi, alpha, bias, y)]


def upstream(shapes, dtypes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(d) for s, d in zip(shapes, dtypes)]


def check_read(case, x_dtype, act_tol, coef_tol):
    variant = case[0]
    iters = 20 if case == CASES[0] else 4
    x, phi, alpha, bias, _ = make_inputs(*case, x_dtype=x_dtype)
    ours = [o for o in mhc_read_triton(x, phi, alpha, bias, variant, iters, 1e-6) if o is not None]
    ref_in = [t.detach().double().requires_grad_() for t in (x, phi, alpha, bias)]
    ref = [o for o in mhc_read_reference(*ref_in, variant, iters, 1e-6) if o is not None]
    names = ["x_in", "h_pre", "h_post", "h_res"]
    assert ours[0].dtype == x_dtype and all(o.dtype == torch.float32 for o in ours[1:])
    for name, o, r in zip(names, ours, ref):
        assert_close(name, o, r, act_tol if name == "x_in" else coef_tol)
    grads = upstream([o.shape for o in ours], [o.dtype for o in ours])
    g_ours = torch.autograd.grad(ours, (x, phi, alpha, bias), grads)
    g_ref = torch.autograd.grad(ref, ref_in, [g.double() for g in grads])
    for name, o, r in zip(["dx", "dphi", "dalpha", "dbias"], g_ours, g_ref):
        assert o.dtype == (x_dtype if name == "dx" else torch.float32)
        assert_close(name, o, r, act_tol if name == "dx" else coef_tol)


def check_post_res(case, x_dtype, act_tol, coef_tol):
    variant = case[0]
    x, phi, alpha, bias, y = make_inputs(*case, x_dtype=x_dtype)
    with torch.no_grad():
        _, _, h_post, h_res = mhc_read_reference(x, phi, alpha, bias, variant, 4)
    coeffs = [h_post.requires_grad_()] + ([] if h_res is None else [h_res.requires_grad_()])
    ours = mhc_post_res_triton(x, y, h_post, h_res)
    assert ours.dtype == x_dtype
    ref_in = [t.detach().double().requires_grad_() for t in [x, y] + coeffs]
    ref = mhc_post_res_reference(*ref_in[:3], ref_in[3] if h_res is not None else None)
    assert_close("x_new", ours, ref, act_tol)
    (grad,) = upstream([ours.shape], [x_dtype])
    g_ours = torch.autograd.grad(ours, [x, y] + coeffs, grad)
    g_ref = torch.autograd.grad(ref, ref_in, grad.double())
    for name, o, r in zip(["dx", "dy", "dh_post", "dh_res"], g_ours, g_ref):
        assert_close(name, o, r, act_tol if name in ("dx", "dy") else coef_tol)


# ---------------------------------------------------------------------------------------
# Sinkhorn-Knopp
# ---------------------------------------------------------------------------------------


def sinkhorn_logits(kind, rows, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(rows, n, n, generator=g)
    if kind == "init":  # the paper's 6I - 3 plus a dynamic part
        return (6 * torch.eye(n) - 3 + 0.3 * noise).to(dtype)
    return (2 * noise).to(dtype)


@pytest.mark.parametrize("kind", ["init", "spread"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_sinkhorn_matches_reference(n, kind):
    """fp32 forward and backward vs the reference (autograd through the unrolled
    iterations), 37 matrices (the kernel's tile is 64)."""
    z = sinkhorn_logits(kind, 37, n).requires_grad_()
    ours, ref = sinkhorn_triton(z, 20), sinkhorn_reference(z, 20)
    assert ours.dtype == torch.float32
    assert_close("sinkhorn", ours, ref, 1e-6)
    (g,) = upstream([ours.shape], [torch.float32])
    (d_ours,) = torch.autograd.grad(ours, z, g)
    (d_ref,) = torch.autograd.grad(ref, z, g)
    assert_close("dlogits", d_ours, d_ref, 1e-5)


def test_sinkhorn_leading_dims_and_bf16_logits():
    """[s, b, n, n] logits, bf16 in: fp32 out, same as the reference on the bf16 values."""
    z = sinkhorn_logits("spread", 15, 4).view(5, 3, 4, 4).bfloat16()
    ours = sinkhorn_triton(z, 20)
    assert ours.dtype == torch.float32 and ours.shape == z.shape
    assert_close("sinkhorn", ours, sinkhorn_reference(z, 20), 1e-6)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sinkhorn_is_doubly_stochastic(n):
    """Rows and columns sum to 1 within 1e-3 after 20 iterations (columns exactly: the last
    step normalises them), for logits near the init and N(0, 1) logits (n > 2), fp32 and
    bf16: the reference's test. (Elsewhere 20 iterations can leave larger row errors, in
    the reference too: docs/methods/mhc.md.)"""
    g = torch.Generator().manual_seed(0)
    init = 6 * torch.eye(n) - 3 + 0.01 * torch.randn(64, n, n, generator=g)
    spread = torch.randn(64, n, n, generator=g)
    for logits in (init, spread) if n > 2 else (init,):
        for dtype in (torch.float32, torch.bfloat16):
            m = sinkhorn_triton(logits.to(dtype), 20)
            assert (m >= 0).all()
            ones = torch.ones(64, n)
            torch.testing.assert_close(m.sum(-1), ones, rtol=0, atol=1e-3)
            torch.testing.assert_close(m.sum(-2), ones, rtol=0, atol=1e-6)


@pytest.mark.parametrize("iters", [1, 5, 20])
def test_sinkhorn_gradient_matches_finite_differences(iters):
    """fp64 kernels vs central differences (the backward is the exact gradient of the
    fixed-iteration map, not the implicit gradient of the converged projection);
    gradcheck's fast mode (random directions)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: sinkhorn_triton(t, iters), (z,), eps=1e-6,
                                    atol=1e-8, rtol=1e-6, fast_mode=True)


def test_sinkhorn_huge_logits_stay_finite():
    z = torch.tensor([[[1000.0, 990.0], [-5.0, 995.0]]], requires_grad=True)
    out = sinkhorn_triton(z, 20)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, sinkhorn_triton(z.detach() - 900.0, 20))
    (d,) = torch.autograd.grad(out, z, torch.randn_like(out))
    assert torch.isfinite(d).all()


# ---------------------------------------------------------------------------------------
# The two fused launches
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_read_matches_reference(case):
    """Launch 1: x_in, H_pre, H_post, H_res and dX, dphi, dalpha, dbias (fp32)."""
    check_read(case, torch.float32, FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_post_res_matches_reference(case):
    """Launch 2: X' and dX, dy, dH_post, dH_res (fp32)."""
    check_post_res(case, torch.float32, FP32_TOL, FP32_TOL)


BF16_CASES = [CASES[0], CASES[1], CASES[5], CASES[8]]


@pytest.mark.parametrize("case", BF16_CASES, ids=case_id)
def test_bf16_activations(case):
    """bf16 streams and sublayer output, fp32 parameters: fp32 coefficients (Sinkhorn in
    fp32) and fp32 parameter gradients; bf16 x_in, X', dX, dy."""
    check_read(case, torch.bfloat16, BF16_ACT_TOL, BF16_COEF_TOL)
    check_post_res(case, torch.bfloat16, BF16_ACT_TOL, BF16_COEF_TOL)


@pytest.mark.parametrize("variant", ["mhc", "hc", "identity"])
def test_fp64_gradcheck(variant):
    """Both launches in fp64 against finite differences (gradcheck's fast mode: random
    directions through every input)."""
    x, phi, alpha, bias, y = (t.detach().double().requires_grad_()
                              for t in make_inputs(variant, 2, 16, 7, 2))

    def read(x, phi, alpha, bias):
        return tuple(o for o in mhc_read_triton(x, phi, alpha, bias, variant, 4) if o is not None)

    assert torch.autograd.gradcheck(read, (x, phi, alpha, bias), eps=1e-6, atol=1e-7,
                                    rtol=1e-5, fast_mode=True)
    with torch.no_grad():
        _, _, h_post, h_res = mhc_read_reference(x, phi, alpha, bias, variant, 4)
    coeffs = [h_post.requires_grad_()] + ([] if h_res is None else [h_res.requires_grad_()])

    def post(x, y, *c):
        return mhc_post_res_triton(x, y, c[0], c[1] if len(c) > 1 else None)

    assert torch.autograd.gradcheck(post, (x, y, *coeffs), eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=True)


def test_backward_is_deterministic():
    """Parameter gradients are fixed-order partial sums: two backward passes are equal
    bit for bit."""
    x, phi, alpha, bias, y = make_inputs("mhc", 4, 80, 37, 1)
    grads = []
    for _ in range(2):
        x_in, _, h_post, h_res = mhc_read_triton(x, phi, alpha, bias, "mhc", 4)
        out = mhc_post_res_triton(x, y * x_in, h_post, h_res)
        grads.append(torch.autograd.grad(out.square().sum(), (x, phi, alpha, bias, y)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# In the model: mixer.impl=triton vs mixer.impl=torch
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["mhc", "hc", "identity"])
def test_model_triton_equals_torch_fp64(megatron_single, variant):
    """The tiny model (4 layers, 3 streams, GQA) with the fused kernels: logits and every
    parameter gradient equal the PyTorch path in fp64 (1e-10 relative), its coefficient
    network away from its init."""
    from depthmix.testing import assert_kernel_model_equals_torch, tiny_run

    assert_kernel_model_equals_torch(
        lambda impl: tiny_run("mhc", variant=variant, streams=3, sinkhorn_iters=7, impl=impl),
        (".phi", ".alpha", ".bias"))
