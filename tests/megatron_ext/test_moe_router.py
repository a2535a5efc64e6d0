"""Megatron-Core's MoE layer as depthmix configures it (``model.moe``), against the routing
arithmetic written from the papers (``tests/moe_reference.py``): gating weights, the choice of
experts, dropping by capacity, the layer's output, the load-balancing and z-losses and the
gradient they add (through Megatron's ``MoEAuxLossAutoScaler``)."""

from __future__ import annotations

import pytest
import torch

import moe_reference as ref
from depthmix.config.schema import MoEConfig

CASES = {
    # Qwen3-MoE style: softmax, top-2 renormalised, Switch/GShard balance loss, dropless
    "softmax_top2_aux": dict(top_k=2, aux_loss_coeff=1e-2),
    # Switch Transformer: top-1 of the softmax over all experts, capacity 1.0, drop by weight
    "switch_top1_capacity": dict(top_k=1, normalize_top_k=False, aux_loss_coeff=1e-2,
                                 dropless=False, capacity_factor=1.0),
    # top-2 over capacity 1.25, no balance loss
    "top2_capacity": dict(top_k=2, aux_loss_coeff=0.0, dropless=False, capacity_factor=1.25),
    # ST-MoE's router z-loss beside the balance loss
    "softmax_z_loss": dict(top_k=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
    # DeepSeek-V3: sigmoid, expert bias, scaled weights, sequence-wise loss, a shared expert
    "deepseek_v3": dict(top_k=3, score_function="sigmoid", expert_bias=True,
                        routed_scaling_factor=2.5, aux_loss_coeff=1e-4,
                        aux_loss_scope="sequence", shared_expert_ffn_hidden_size=24),
}
SEQ, BATCH, EXPERTS = 8, 3, 6


def build_layer(moe: MoEConfig):
    """Megatron's MoE layer from depthmix's spec, on a 4-layer tiny model's config."""
    from megatron.core.transformer.spec_utils import build_module

    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.megatron_ext.moe import get_moe_spec
    from depthmix.testing import tiny_run

    run = tiny_run()
    run.model.moe = moe
    config = to_transformer_config(run)
    torch.manual_seed(0)
    layer = build_module(get_moe_spec(config), config=config, pg_collection=None)
    layer.set_layer_number(2)
    return layer.train()


def megatron_losses() -> dict:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: float(entry["values"][1]) for name, entry in
            get_moe_layer_wise_logging_tracker().items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_moe_layer_matches_the_papers_arithmetic(megatron_single, case):
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        get_moe_layer_wise_logging_tracker,
    )

    moe = MoEConfig(num_experts=EXPERTS, ffn_hidden_size=32, **CASES[case])
    layer = build_layer(moe)
    router = layer.router
    g = torch.Generator().manual_seed(1)
    if moe.expert_bias:  # as after some steps of updates: it changes the choice
        router.expert_bias.copy_(torch.randn(EXPERTS, generator=g) * 0.05)
    h = layer.config.hidden_size
    x = torch.randn(SEQ, BATCH, h, generator=g, requires_grad=True)
    upstream = torch.randn(SEQ, BATCH, h, generator=g)

    # Megatron: the router alone (weights and choice), then the layer with its losses
    get_moe_layer_wise_logging_tracker().clear()
    with torch.no_grad():
        probs, routing_map = router(x)
    get_moe_layer_wise_logging_tracker().clear()
    y, bias = layer(x)
    assert bias is None
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale  # process-wide: put it back after
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1)  # the losses' weight: 1
    try:
        (y * upstream).sum().backward()
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale
    losses = megatron_losses()

    # the papers, in float64 on the same weights
    x64 = x.detach().double().view(-1, h).requires_grad_()
    w64 = router.weight.detach().double().requires_grad_()
    logits = x64 @ w64.t()
    expert_bias = router.expert_bias.double() if moe.expert_bias else None
    weights, chosen = ref.route(logits, moe, expert_bias)
    if not moe.dropless:
        weights, chosen = ref.drop_over_capacity(weights, chosen, moe)
        assert chosen.sum() < SEQ * BATCH * moe.top_k  # the case drops something
    experts = [(e.linear_fc1.weight.detach().double(), e.linear_fc2.weight.detach().double())
               for e in layer.experts.local_experts]
    shared = None
    if moe.shared_expert_ffn_hidden_size:
        s = layer.shared_experts
        shared = (s.linear_fc1.weight.detach().double(), s.linear_fc2.weight.detach().double())
    y_ref = ref.moe_layer(x64, weights, experts, shared)
    objective = (y_ref * upstream.double().view(-1, h)).sum()
    aux = ref.aux_loss(logits, moe, SEQ) if moe.aux_loss_coeff else None
    z = ref.z_loss(logits) if moe.z_loss_coeff else None
    for coeff, loss in ((moe.aux_loss_coeff, aux), (moe.z_loss_coeff, z)):
        if loss is not None:
            objective = objective + coeff * loss
    objective.backward()

    assert torch.equal(routing_map, chosen)
    torch.testing.assert_close(probs.double(), weights.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.detach().double().view(-1, h), y_ref.detach(), rtol=1e-5,
                               atol=1e-5)
    name = {"batch": "load_balancing_loss", "sequence": "seq_load_balancing_loss"}
    expected = {}
    if aux is not None:
        expected[name[moe.aux_loss_scope]] = float(aux)
    if z is not None:
        expected["z_loss"] = float(z)
    assert losses == pytest.approx(expected, rel=1e-5)
    # the losses reach the router weight and the input as their coefficients say
    torch.testing.assert_close(router.weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(x.grad.double().view(-1, h), x64.grad, rtol=1e-4, atol=1e-6)


def test_expert_load_router_counts_training_forwards_only(megatron_single):
    """What the console's expert-load line reads: assignments per expert under gradients
    (not in evaluation or a no-grad pass), dropped ones excluded; ``take`` zeroes them."""
    moe = MoEConfig(num_experts=EXPERTS, top_k=2, dropless=False, capacity_factor=1.0)
    router = build_layer(moe).router
    x = torch.randn(SEQ, BATCH, router.config.hidden_size)
    with torch.no_grad():
        router(x)
    _, routing_map = router(x)
    router(x)
    counts = router.take()
    assert counts[:-1].tolist() == (2 * routing_map.sum(0)).tolist()
    assert counts[-1] == 2 * SEQ * BATCH * 2 and counts[:-1].sum() < counts[-1]
    assert router.take().sum() == 0
