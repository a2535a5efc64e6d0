"""Grouped-GEMM experts (``model.moe.experts_impl=grouped``, ``torch._grouped_mm``) against
Megatron's ``SequentialMLP``, the reference: the same parameters, the same outputs and
gradients on random tokens (experts without tokens too, and no tokens at all), inside the
whole MoE layer; on the CPU through torch's CPU kernel, on a GPU (marked ``gpu``) through
its CUTLASS kernel in bf16. A checkpoint written with either loads in the other:
tests/pretrain/test_moe_training.py."""

from __future__ import annotations

import pytest
import torch

from depthmix.config.schema import MoEConfig

EXPERTS, HIDDEN, WIDTH = 6, 64, 32


def build_layer(impl: str, seed: int = 0, device: str = "cpu", precision: str = "fp32",
                hidden: int = HIDDEN, width: int = WIDTH):
    """Megatron's MoE layer from depthmix's spec with ``impl`` experts (6 of them, top-2)."""
    from megatron.core.transformer.spec_utils import build_module

    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.megatron_ext.moe import get_moe_spec
    from depthmix.runtime.precision import torch_dtype
    from depthmix.testing import tiny_run

    run = tiny_run()
    run.model.hidden_size = hidden
    run.train.precision = precision
    run.model.moe = MoEConfig(num_experts=EXPERTS, top_k=2, ffn_hidden_size=width,
                              aux_loss_coeff=0.0, experts_impl=impl)
    config = to_transformer_config(run)
    assert config.moe_experts_impl == impl
    torch.manual_seed(seed)
    layer = build_module(get_moe_spec(config), config=config, pg_collection=None)
    layer.set_layer_number(1)
    return layer.to(device=device, dtype=torch_dtype(precision)).train()


def pair(**kwargs):
    """A sequential layer and a grouped one holding its weights (a strict state-dict load:
    the same parameter names and shapes)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from depthmix.megatron_ext.grouped_experts import GroupedExperts

    sequential = build_layer("sequential", **kwargs)
    grouped = build_layer("grouped", seed=1, **kwargs)
    assert isinstance(grouped.experts, GroupedExperts)
    assert isinstance(sequential.experts, SequentialMLP)
    assert not isinstance(sequential.experts, GroupedExperts)
    grouped.load_state_dict(sequential.state_dict(), strict=True)
    return sequential, grouped


def run_experts(layer, x, counts, probs, upstream):
    """The experts alone on dispatcher-sorted tokens: the output and every gradient."""
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    out, bias = layer.experts(x, counts, probs)
    assert bias is None
    out.backward(upstream)
    grads = {name: p.grad.clone() for name, p in layer.experts.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, probs.grad, grads


def assert_same(a, b, rtol, atol):
    (out_a, x_a, p_a, w_a), (out_b, x_b, p_b, w_b) = a, b
    torch.testing.assert_close(out_b, out_a, rtol=rtol, atol=atol)
    torch.testing.assert_close(x_b, x_a, rtol=rtol, atol=atol)
    torch.testing.assert_close(p_b, p_a, rtol=rtol, atol=atol)
    assert w_a.keys() == w_b.keys()
    for name in w_a:
        torch.testing.assert_close(w_b[name], w_a[name], rtol=rtol, atol=atol, msg=name)


COUNTS = {
    "zero_token_experts": [5, 0, 7, 0, 3, 1],
    "one_expert_takes_all": [0, 0, 16, 0, 0, 0],
    "one_token_each": [1, 1, 1, 1, 1, 1],
    "no_tokens": [0, 0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("case", sorted(COUNTS))
def test_grouped_experts_equal_sequential_outputs_and_gradients(megatron_single, case):
    sequential, grouped = pair()
    counts = torch.tensor(COUNTS[case])  # on the CPU, as Megatron's dispatcher hands them
    g = torch.Generator().manual_seed(2)
    tokens = int(counts.sum())
    x = torch.randn(tokens, HIDDEN, generator=g)
    probs = torch.rand(tokens, generator=g)
    upstream = torch.randn(tokens, HIDDEN, generator=g)
    ref = run_experts(sequential, x, counts, probs, upstream)
    got = run_experts(grouped, x, counts, probs, upstream)
    assert_same(ref, got, rtol=1e-5, atol=1e-6)
    grads = ref[3]
    for e, n in enumerate(COUNTS[case]):  # an expert without tokens: a zero gradient, not None
        w = grads[f"local_experts.{e}.linear_fc1.weight"]
        assert (w.abs().sum() == 0) == (n == 0), (e, n)


def test_the_moe_layer_routes_into_grouped_experts_as_into_sequential(megatron_single):
    """Router, dispatcher and experts: the same output and gradients, with an expert that the
    router never picks (all its logits pushed down) and uneven loads on the others."""
    from depthmix.megatron_ext.moe import ExpertLoadRouter

    sequential, grouped = pair()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 2, HIDDEN, generator=g).abs()
    upstream = torch.randn(8, 2, HIDDEN, generator=g)
    results, loads = [], []
    for layer in (sequential, grouped):
        with torch.no_grad():
            layer.router.weight[0] = -1.0  # x > 0: expert 0 is always last
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        out.backward(upstream)
        results.append((out.detach(), xi.grad, {n: p.grad.clone()
                                                for n, p in layer.named_parameters()}))
        router = next(m for m in layer.modules() if isinstance(m, ExpertLoadRouter))
        loads.append(router.take()[:-1].tolist())
    assert loads[0] == loads[1] and loads[0][0] == 0 and sum(loads[0]) == 2 * 16, loads
    (out_a, x_a, w_a), (out_b, x_b, w_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_b, x_a, rtol=1e-5, atol=1e-6)
    for name in w_a:
        torch.testing.assert_close(w_b[name], w_a[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_the_cutlass_grouped_gemm_equals_sequential_in_bf16(megatron_single):
    """On a GPU in bf16 (torch's CUTLASS kernel on sm90/sm100): group sizes that are no
    multiple of 8 and empty groups, at widths of the 1p5b_moe preset's tensor shapes' kind."""
    sequential, grouped = pair(device="cuda", precision="bf16", hidden=256, width=128)
    counts = torch.tensor([37, 0, 1, 250, 0, 13])
    g = torch.Generator().manual_seed(4)
    tokens = int(counts.sum())
    x = torch.randn(tokens, 256, generator=g).to("cuda", torch.bfloat16)
    probs = torch.rand(tokens, generator=g).cuda()
    upstream = torch.randn(tokens, 256, generator=g).to("cuda", torch.bfloat16)
    ref = run_experts(sequential, x, counts, probs, upstream)
    got = run_experts(grouped, x, counts, probs, upstream)
    assert_same(ref, got, rtol=2e-2, atol=2e-2)
