"""Experts under every mixer, in process on one rank: the loss falls, the console shows the
experts' losses and load; the load-balancing loss reaches the router as Megatron's schedule
scales it; recomputation changes nothing; the expert bias moves once a step (DeepSeek-V3's
rule) and is in the checkpoint. The routing arithmetic itself: tests/megatron_ext/
test_moe_router.py (both against tests/moe_reference.py)."""

from __future__ import annotations

import pytest
import torch

import moe_reference as ref
from depthmix.config.schema import MoEConfig
from depthmix.mixers import available
from depthmix.testing import SyntheticData, gather_full, tiny_run


def moe_run(tmp_path, mixer: str = "vanilla", steps: int = 6, **moe):
    """The 4-layer tiny model, layers 1-3 with 4 experts of width 32, 2 per token; two
    micro-batches of two 16-token samples a step."""
    run = tiny_run(mixer)
    options = dict(num_experts=4, top_k=2, ffn_hidden_size=32, first_dense_layers=1,
                   aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    run.model.moe = MoEConfig(**{**options, **moe})
    t = run.train
    t.micro_batch_size, t.global_batch_size, t.steps = 2, 4, steps
    t.lr, t.warmup_fraction, t.lr_decay_style = 1e-2, 0.0, "constant"
    t.eval_interval, t.log_interval = 0, 3
    run.logger.wandb, run.logger.progress = False, False
    run.output_dir = str(tmp_path)
    run.train.save_dir = str(tmp_path / "ckpt")
    return run


class SameBatches(SyntheticData):
    """The first step's micro-batches again and again: a model that trains fits them."""

    def __init__(self, run, *args, **kwargs):
        super().__init__(run, *args, **kwargs)
        steps = run.train.global_batch_size // run.train.micro_batch_size
        first = [next(self.train_iterator) for _ in range(steps)]
        self.train_iterator = (first[i % steps] for i in range(10**9))


def routers(trainer) -> list:
    from depthmix.megatron_ext.model import unwrap
    from depthmix.megatron_ext.moe import ExpertLoadRouter

    return [m for chunk in trainer.model for m in unwrap(chunk).modules()
            if isinstance(m, ExpertLoadRouter)]


@pytest.mark.parametrize("mixer", available())
def test_every_mixer_trains_over_experts(megatron_single, tmp_path, mixer):
    from depthmix.pretrain.callbacks import ConsoleLogger
    from depthmix.pretrain.trainer import Trainer

    lines, losses = [], []
    run = moe_run(tmp_path, mixer)
    trainer = Trainer(run, data=SameBatches, callbacks=[ConsoleLogger(printer=lines.append)])
    assert len(routers(trainer)) == 3  # layers 1-3; layer 0 stays dense
    for _ in range(run.train.steps):
        losses.append(trainer.train_one_step())
        trainer.callbacks[0].post_step(trainer, losses[-1])
    assert losses[-1].loss < losses[0].loss - 0.1, [r.loss for r in losses]
    steps = [line for line in lines if line.startswith("step")]
    experts = [line for line in lines if line.startswith("experts")]
    assert len(steps) == len(experts) == 3  # steps 1, 3 and 6
    assert all(" | aux " in line and " | z " in line for line in steps), steps
    assert "load max/mean" in experts[0] and "dropped 0 of 384" in experts[0], experts
    load = losses[0].experts
    assert load.layers == [1, 2, 3]
    assert all(sum(load.tokens[u]) == load.assigned[u] == 2 * 4 * 16 for u in load.layers)
    # the balance loss is at least 1 (equality: perfectly balanced), the z-loss positive
    assert all(v >= 0.99 for v in load.aux_loss.values()) and min(load.z_loss.values()) > 0
    scalars = load.as_dict()  # W&B: means, then per layer
    assert scalars["moe/aux_loss"] == pytest.approx(sum(load.aux_loss.values()) / 3)
    assert all(scalars[f"moe/tokens_mean/layer{u}"] == 128 / 4 for u in load.layers)
    assert all(f"moe/{k}/layer{u}" in scalars for u in load.layers
               for k in ("aux_loss", "z_loss", "load_max_over_mean", "tokens_max", "dropped"))


def _one_step(run):
    """A trainer after one step, the step's gradients and the weights they are of (by global
    name), and the last router's input of each micro-batch."""
    from depthmix.pretrain.trainer import Trainer

    trainer = Trainer(run, data=SyntheticData, callbacks=[])
    inputs, seen = [], {}
    routers(trainer)[-1].register_forward_hook(
        lambda module, args, out: inputs.append(args[0].detach().clone()))

    def before_update(model):
        seen.update(grads=gather_full(model), params=gather_full(model, "param"))

    trainer.train_one_step(after_backward=before_update)
    return trainer, seen["grads"], seen["params"], inputs


def test_balance_loss_reaches_the_router_scaled_per_micro_batch(megatron_single, tmp_path):
    """Megatron's schedule sets ``MoEAuxLossAutoScaler``'s scale to 1 / micro-batches (as it
    divides the language-model loss): the last MoE layer's router gradient moves by exactly
    coeff * the mean over micro-batches of d(balance loss)/dW (its loss reaches no other
    layer's router; the forward, hence the language-model gradient, is the same)."""
    coeff, name = 0.5, "decoder.layers.3.mlp.router.weight"
    _, plain, _, _ = _one_step(moe_run(tmp_path, aux_loss_coeff=0.0, z_loss_coeff=0.0))
    run = moe_run(tmp_path, aux_loss_coeff=coeff, z_loss_coeff=0.0)
    _, balanced, params, inputs = _one_step(run)
    assert len(inputs) == 2  # two micro-batches
    w64 = params[name].double().requires_grad_()
    total = sum(ref.aux_loss(x.double().view(-1, x.shape[-1]) @ w64.t(), run.model.moe,
                             run.model.seq_length) for x in inputs)
    (coeff * total / len(inputs)).backward()
    torch.testing.assert_close((balanced[name] - plain[name]).double(), w64.grad,
                               rtol=1e-4, atol=1e-6)
    assert w64.grad.abs().max() > 1e-3  # the loss has a gradient to check


def test_recomputation_routes_and_counts_once(megatron_single, tmp_path):
    """``parallel.recompute=full`` re-runs each layer, router included, in backward: the same
    gradients (balance and z-losses too) and the same expert load as without."""
    results = []
    for recompute in ("none", "full"):
        run = moe_run(tmp_path, steps=1)
        run.parallel.recompute = recompute
        trainer, grads, _, _ = _one_step(run)
        results.append((grads, trainer.last.experts))
    (ref_grads, ref_load), (grads, load) = results
    assert load == ref_load
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_expert_bias_moves_once_a_step_and_is_checkpointed(megatron_single, tmp_path):
    from depthmix.pretrain.trainer import Trainer

    rate = 1e-2
    run = moe_run(tmp_path, steps=4, score_function="sigmoid", expert_bias=True,
                  expert_bias_update_rate=rate, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    run.train.log_interval = 100  # step 2 is no log step: its counts stay in the routers
    trainer = Trainer(run, data=SyntheticData, callbacks=[])
    trainer.train_one_step()
    before = [r.expert_bias.clone() for r in routers(trainer)]
    assert all(b.abs().sum() > 0 for b in before)  # step 1 moved it
    trainer.train_one_step()
    for router, bias in zip(routers(trainer), before):
        load = router.routed.tolist()
        assert sum(load) == 2 * 2 * 2 * 16  # two micro-batches of 2 x 16 tokens, top-2
        torch.testing.assert_close(router.expert_bias, ref.updated_bias(bias, load, rate),
                                   rtol=0, atol=1e-6)
    saved = [r.expert_bias.clone() for r in routers(trainer)]
    trainer.save_checkpoint()
    del trainer
    resumed = Trainer(run, data=SyntheticData, callbacks=[])
    assert resumed.step == 2
    for router, bias in zip(routers(resumed), saved):
        assert torch.equal(router.expert_bias, bias)


def test_a_checkpoint_moves_between_sequential_and_grouped_experts(megatron_single, tmp_path):
    """``model.moe.experts_impl`` holds the same parameters either way: a run saved with
    sequential experts resumes with grouped ones (``torch._grouped_mm``, its CPU kernel here)
    and back, the weights bit for bit, and the losses follow the run that never switched
    (within the two GEMMs' rounding: the optimizer state came along)."""
    from depthmix.megatron_ext.grouped_experts import GroupedExperts
    from depthmix.megatron_ext.model import unwrap
    from depthmix.pretrain.trainer import Trainer

    def trainer_of(impl, directory):
        run = moe_run(directory, steps=6, experts_impl=impl)
        trainer = Trainer(run, data=SyntheticData, callbacks=[])
        grouped = [m for c in trainer.model for m in unwrap(c).modules()
                   if isinstance(m, GroupedExperts)]
        assert len(grouped) == (3 if impl == "grouped" else 0)
        return trainer

    reference = trainer_of("sequential", tmp_path / "reference")
    expected = [reference.train_one_step().loss for _ in range(6)]
    del reference
    losses, saved = [], None
    for impl in ("sequential", "grouped", "sequential"):
        trainer = trainer_of(impl, tmp_path / "switching")
        assert trainer.step == len(losses)
        if saved is not None:
            loaded = gather_full(trainer.model, "param")
            assert loaded.keys() == saved.keys()
            assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        losses += [trainer.train_one_step().loss for _ in range(2)]
        saved = gather_full(trainer.model, "param")
        trainer.save_checkpoint()
        del trainer
    assert losses == pytest.approx(expected, rel=1e-5)
    assert losses[:2] == expected[:2]  # sequential both times: the same arithmetic
