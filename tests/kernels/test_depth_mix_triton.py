"""The fused ``depth_mix`` Triton kernel vs the PyTorch reference (Triton interpreter on CPU).

Forward outputs and the gradient of every input (query, key, value, each source key and
value) for random output gradients. Error measure: ``||ours - ref|| / ||ref||`` (and the
max abs error relative to ``max |ref|``) per tensor.

* fp32 inputs vs the reference in fp32: both within ``FP32_TOL = 1e-5`` (observed ~2e-7:
  the kernel's online softmax and summation order differ from the reference's).
* bf16 inputs vs the fp32 reference on the same (bf16-rounded) inputs: the kernel computes
  in fp32 and rounds its outputs and gradients to bf16 once, so the error is that rounding.
  On a GPU the cast rounds to nearest (expected norm ratio ~1.7e-3, what the reference's
  own outputs rounded to bf16 give; not measured here); Triton's CPU interpreter truncates fp32 -> bf16, which
  doubles it (observed 3.4e-3, max abs 6.1e-3 of ``max |ref|``). Tolerances: norm ratio
  ``BF16_TOL = 6e-3``, max abs ``2^-6 = 1.6e-2`` of ``max |ref|`` (one truncation is
  < 2^-7 relative; autograd adds the identity path of an unmixed key in bf16).
"""

from __future__ import annotations

import pytest
import torch

from depthmix.kernels.depth_mix import depth_mix_reference, depth_mix_triton
from depthmix.mixers.depth_attn import MIX_RULES, MIXED_STATES

FP32_TOL = 1e-5
BF16_TOL = 6e-3
BF16_MAX_TOL = 2**-6

# (T, B, KV heads, G, head dim, S, sources given as "list" | "stacked"); the interpreter's
# tile is 64 rows (T*B), so every T*B below leaves a partial tile
SHAPES = [
    (37, 1, 2, 1, 64, 1, "list"),
    (37, 3, 2, 4, 80, 3, "list"),
    (37, 1, 1, 4, 128, 3, "stacked"),
    (21, 3, 3, 2, 80, 1, "stacked"),
    (150, 1, 2, 1, 128, 3, "list"),
]
MODES = [(rule, state) for rule in MIX_RULES for state in MIXED_STATES]


def shape_id(shape) -> str:
    t, b, ng, g, hn, s, kind = shape
    return f"T{t}-B{b}-ng{ng}-G{g}-hd{hn}-S{s}-{kind}"


def make_inputs(shape, dtype=torch.float32, seed=0):
    t, b, ng, g, hn, s, kind = shape
    gen = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(dtype)

    query, key, value = rand(t, b, ng * g, hn), rand(t, b, ng, hn), rand(t, b, ng, hn)
    if kind == "stacked":
        src_keys, src_values = rand(s, t, b, ng, hn), rand(s, t, b, ng, hn)
    else:
        src_keys = [rand(t, b, ng, hn) for _ in range(s)]
        src_values = [rand(t, b, ng, hn) for _ in range(s)]
    return query, key, value, src_keys, src_values


def leaves(inputs):
    """Inputs as fresh leaves that require grad (lists stay lists)."""
    out = []
    for x in inputs:
        if isinstance(x, list):
            out.append([y.detach().clone().requires_grad_() for y in x])
        else:
            out.append(x.detach().clone().requires_grad_())
    return out


def flat(inputs):
    return [y for x in inputs for y in (x if isinstance(x, list) else [x])]


def run(fn, inputs, mix_rule, mixed_state, out_grads=None, **kwargs):
    """Outputs and input gradients (None where an input does not influence the outputs)."""
    key_out, value_out = fn(*inputs, mix_rule=mix_rule, mixed_state=mixed_state, **kwargs)
    if out_grads is None:
        gen = torch.Generator().manual_seed(1)
        out_grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in (key_out, value_out)]
    loss = (key_out.float() * out_grads[0].float()).sum() + (value_out.float() * out_grads[1].float()).sum()
    grads = torch.autograd.grad(loss, flat(inputs), allow_unused=True)
    return [key_out, value_out], list(grads), out_grads


def err_ratio(a: torch.Tensor, b: torch.Tensor):
    a, b = a.double(), b.double()
    scale = max(b.norm().item(), 1e-30)
    return (a - b).norm().item() / scale, (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def assert_matches(ours, ref, tol, max_tol, label):
    for i, (a, b) in enumerate(zip(ours, ref)):
        if b is None:
            assert a is None or not a.any(), f"{label}: tensor {i} has a gradient it should not"
            continue
        assert a is not None, f"{label}: tensor {i} got no gradient"
        assert a.shape == b.shape
        ratio, max_err = err_ratio(a, b)
        assert ratio <= tol and max_err <= max_tol, (
            f"{label}: tensor {i}: norm ratio {ratio:.2e}, max err {max_err:.2e} (tol {tol:.0e})")


@pytest.mark.parametrize("mix_rule,mixed_state", MODES, ids=[f"{r}-{s}" for r, s in MODES])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_fp32_matches_reference(shape, mix_rule, mixed_state):
    inputs = make_inputs(shape)
    a = leaves(inputs)
    outs, grads, dout = run(depth_mix_triton, a, mix_rule, mixed_state)
    b = leaves(inputs)
    ref_outs, ref_grads, _ = run(depth_mix_reference, b, mix_rule, mixed_state, dout)
    assert_matches(outs, ref_outs, FP32_TOL, FP32_TOL, "forward")
    assert_matches(grads, ref_grads, FP32_TOL, FP32_TOL, "backward")


BF16_CASES = [
    (SHAPES[1], "softmax", "value"),
    (SHAPES[1], "softmax", "key_value"),
    (SHAPES[2], "softmax", "key"),
    (SHAPES[3], "uniform", "key_value"),
]


@pytest.mark.parametrize("shape,mix_rule,mixed_state", BF16_CASES,
                         ids=[f"{shape_id(s)}-{r}-{m}" for s, r, m in BF16_CASES])
def test_bf16_matches_fp32_reference(shape, mix_rule, mixed_state):
    inputs = make_inputs(shape, torch.bfloat16)
    a = leaves(inputs)
    outs, grads, dout = run(depth_mix_triton, a, mix_rule, mixed_state)
    for t in (*outs, *(g for g in grads if g is not None)):
        assert t.dtype == torch.bfloat16
    b = leaves([[y.float() for y in x] if isinstance(x, list) else x.float() for x in inputs])
    ref_outs, ref_grads, _ = run(depth_mix_reference, b, mix_rule, mixed_state,
                                 [g.float() for g in dout])
    assert_matches(outs, ref_outs, BF16_TOL, BF16_MAX_TOL, "forward")
    assert_matches(grads, ref_grads, BF16_TOL, BF16_MAX_TOL, "backward")


def test_fp64_inputs_compute_in_fp64():
    shape = (19, 2, 2, 2, 64, 2, "list")
    inputs = make_inputs(shape, torch.float64)
    outs, grads, dout = run(depth_mix_triton, leaves(inputs), "softmax", "key_value")
    ref_outs, ref_grads, _ = run(depth_mix_reference, leaves(inputs), "softmax", "key_value", dout)
    # the score scale enters the kernel as an fp32 scalar: ~3e-8 relative
    assert_matches(outs, ref_outs, 1e-7, 1e-7, "forward")
    assert_matches(grads, ref_grads, 1e-7, 1e-7, "backward")


@pytest.mark.parametrize("mixed_state", MIXED_STATES)
def test_no_sources_is_the_identity(mixed_state):
    """S = 0 (the first layer): the very input tensors come back, no kernel runs."""
    query, key, value, _, _ = make_inputs((5, 1, 2, 2, 64, 1, "list"))
    for src in (None, [], torch.empty(0, 5, 1, 2, 64)):
        k_out, v_out = depth_mix_triton(query, key, value, src, src, mixed_state=mixed_state)
        assert k_out is key and v_out is value


def test_megatron_layout_views_and_packed_sources():
    """q/k/v as strided views of one fused projection (Megatron's split), sources as views
    at arbitrary offsets of one flat buffer (the packed pipeline tensor), out of order;
    gradients land in the buffer's gradient."""
    t, b, ng, g, hn, s = 23, 2, 2, 2, 80, 3
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, b, ng, (g + 2) * hn, generator=gen, requires_grad=True)
    n = t * b * ng * hn
    packed = torch.randn(7 + 2 * s * n + 5, generator=gen, requires_grad=True)
    offsets = [7 + 4 * n, 7 + n, 7 + 2 * n + 3]  # not ascending, not aligned to a source

    def split(qkv_, packed_):
        query, key, value = torch.split(qkv_, [g * hn, hn, hn], dim=-1)
        query = query.reshape(t, b, ng * g, hn)  # as Megatron does (a copy)
        srcs = [packed_[o:o + n].view(t, b, ng, hn) for o in offsets]
        return query, key, value, srcs, [srcs[1], srcs[2], srcs[0]]

    def go(fn):
        q_, p_ = qkv.detach().clone().requires_grad_(), packed.detach().clone().requires_grad_()
        query, key, value, sk, sv = split(q_, p_)
        assert not key.is_contiguous() and not value.is_contiguous()
        k_out, v_out = fn(query, key, value, sk, sv, mixed_state="key_value")
        gen_o = torch.Generator().manual_seed(4)
        loss = ((k_out * torch.randn(k_out.shape, generator=gen_o)).sum()
                + (v_out * torch.randn(v_out.shape, generator=gen_o)).sum())
        loss.backward()
        return [k_out, v_out, q_.grad, p_.grad]

    assert_matches(go(depth_mix_triton), go(depth_mix_reference), FP32_TOL, FP32_TOL, "views")


def test_sources_with_different_strides():
    """A non-contiguous source among contiguous ones (copied to a common layout)."""
    shape = (13, 2, 2, 1, 64, 2, "list")
    query, key, value, sk, sv = make_inputs(shape)
    sk[1] = sk[1].transpose(0, 1).contiguous().transpose(0, 1)  # same values, [b, s] memory
    inputs = [query, key, value, sk, sv]
    outs, grads, dout = run(depth_mix_triton, leaves(inputs), "softmax", "value")
    ref_outs, ref_grads, _ = run(depth_mix_reference, leaves(inputs), "softmax", "value", dout)
    assert_matches(outs + grads, ref_outs + ref_grads, FP32_TOL, FP32_TOL, "strides")


def test_bad_arguments_are_refused():
    query, key, value, sk, sv = make_inputs((5, 1, 2, 2, 64, 2, "list"))
    with pytest.raises(ValueError, match="mix_rule"):
        depth_mix_triton(query, key, value, sk, sv, mix_rule="max")
    with pytest.raises(ValueError, match="mixed_state"):
        depth_mix_triton(query, key, value, sk, sv, mixed_state="query")
    with pytest.raises(ValueError, match="keys of all 2 sources"):
        depth_mix_triton(query, key, value, None, sv)
    with pytest.raises(ValueError, match="1 source keys for 2 source values"):
        depth_mix_triton(query, key, value, sk[:1], sv, mixed_state="key_value")
    big = torch.randn(3, 1, 1, 320)
    with pytest.raises(ValueError, match="head dims <= 256"):
        depth_mix_triton(big, big, big, [big], [big])


def test_mixer_uses_the_kernel_for_impl_triton():
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.kernels.dispatch import select
    from depthmix.mixers.depth_attn.model import DepthAttention
    from depthmix.testing import tiny_run

    assert select("depth_mix", "triton") is depth_mix_triton
    assert select("depth_mix", "torch") is depth_mix_reference
    with pytest.raises(ValueError, match="impl='cuda' is not resolved"):
        select("depth_mix", "cuda")
    run_cfg = tiny_run("depth_attn", stride=1)
    run_cfg.mixer.impl = "triton"
    mixer = DepthAttention(to_transformer_config(run_cfg))
    assert mixer.depth_mix is depth_mix_triton
