"""Generation with experts: Megatron's MoE layer under every mixer decodes through the KV
cache as the full forward computes, and a batch of prompts of different lengths gives each
prompt what it gives alone; generating counts no expert load and moves no expert bias; a
checkpoint trained with a capacity (tokens dropped) generates dropless."""

import pytest
import torch

from depthmix.config.schema import MoEConfig
from depthmix.inference.generate import generate, left_pad
from depthmix.mixers import available
from depthmix.testing import build_model, incremental_logits, tiny_run

ROUTERS = {
    "softmax": dict(num_experts=4, top_k=2, ffn_hidden_size=32, first_dense_layers=1,
                    aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
    "sigmoid_bias_shared": dict(num_experts=6, top_k=3, ffn_hidden_size=24,
                                shared_expert_ffn_hidden_size=32, first_dense_layers=1,
                                score_function="sigmoid", expert_bias=True,
                                routed_scaling_factor=2.5, aux_loss_coeff=0.0),
}
DEFAULT = {("vanilla", "softmax"), ("attnres_block", "sigmoid_bias_shared")}
CASES = [pytest.param(mixer, router, id=f"{mixer}-{router}",
                      marks=() if (mixer, router) in DEFAULT else pytest.mark.full)
         for mixer in available() for router in ROUTERS]


def moe_model(mixer: str, **moe):
    run = tiny_run(mixer)
    run.model.moe = MoEConfig(**moe)
    torch.manual_seed(0)
    return build_model(run).eval(), run


def routers(model) -> list:
    from depthmix.megatron_ext.moe import ExpertLoadRouter

    return [m for m in model.modules() if isinstance(m, ExpertLoadRouter)]


@pytest.mark.parametrize("mixer,router", CASES)
def test_cached_decoding_with_experts_equals_the_full_forward(megatron_single, mixer, router):
    model, _ = moe_model(mixer, **ROUTERS[router])
    g = torch.Generator().manual_seed(1)
    for r in routers(model):
        if r.expert_bias is not None:  # as after training: the bias decides some choices
            r.expert_bias.copy_(0.05 * torch.randn(r.expert_bias.shape, generator=g))
    biases = [None if r.expert_bias is None else r.expert_bias.clone()
              for r in routers(model)]
    x = torch.randint(2, 128, (2, 12), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(incremental_logits(model, x, prefill=4), model(x),
                                   rtol=1e-5, atol=1e-5)

    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (5, 1, 8)]
    ids, mask = left_pad(prompts, pad_id=1)
    batched = generate(model, ids, 5, attention_mask=mask)[:, ids.shape[1]:]
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), 5)[0, len(prompt):]
        assert torch.equal(alone, batched[row]), row

    for r, bias in zip(routers(model), biases):  # load counts: training forwards only
        assert int(r.routed.sum()) == int(r.assigned) == 0
        if bias is not None:
            assert torch.equal(r.expert_bias, bias) and not r.local_tokens_per_expert.any()


def test_a_checkpoint_trained_with_a_capacity_generates_dropless(megatron_single, tmp_path):
    """Capacity counts the tokens of one forward: a one-token decoding step would keep what
    the whole sequence drops. ``load_model`` turns dropping off, so cached decoding is the
    full forward's, which differs from the capacity model's."""
    from depthmix.data.tokenizer import train_bpe_tokenizer
    from depthmix.inference.load import load_model
    from depthmix.testing import train_and_save

    _, run = moe_model("vanilla", num_experts=4, top_k=2, ffn_hidden_size=32,
                       dropless=False, capacity_factor=0.5)
    run.model.vocab_size = 320  # the tokenizer's bytes
    run.train.micro_batch_size = run.train.global_batch_size = 2
    run.train.steps, run.train.eval_interval = 1, 0
    run.logger.wandb, run.logger.mode, run.logger.progress = False, "disabled", False
    tokenizer = str(tmp_path / "tokenizer.json")
    train_bpe_tokenizer(["a tiny model for a tiny test"] * 8, 300, tokenizer)
    loaded = load_model(train_and_save(run, str(tmp_path / "ckpt"), tokenizer))
    assert loaded.run.model.experts.dropless and loaded.model.config.moe_expert_capacity_factor \
        is None

    capacity = build_model(run).eval()
    capacity.load_state_dict(loaded.model.state_dict())
    x = torch.randint(2, 320, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = loaded.model(x)
        torch.testing.assert_close(incremental_logits(loaded.model, x), full, rtol=1e-5,
                                   atol=1e-5)
        assert (capacity(x) - full).abs().max() > 1e-4  # tokens were dropped
