"""Overlapped data-parallel communication (``parallel.overlap_grad_reduce``,
``overlap_param_gather``; :mod:`depthmix.pretrain.overlap`), CPU, gloo, fp32.

One group of 2 ranks and one of 4 run every case one after the other (Megatron's parallel
state is rebuilt between runs):

* parity: at DP2 + distributed optimizer (the full lane: DP2, PP2 x DP2 and PP2 x VP2 x
  DP2, both with the distributed optimizer; the interleaved one with
  ``align_param_gather``; with experts at EP2 x expert DP2, whose buckets reduce over
  their own group), for vanilla and two depth mixers, overlap on trains exactly as
  overlap off: losses, gradient norms, full gradients after steps 1 and 2 (step 2 is the
  first whose reductions overlap: Megatron learns the bucket order in step 1) and the
  evaluation loss after step 4, bit for bit
  (the buckets and their reduction order are the same), and every data-parallel replica
  ends with the same weights (the last parameter all-gather was finished);
* a resume from a checkpoint saved with overlap on is bit-exact; ``on_nonfinite=skip`` and
  ``rollback`` (only one replica's batch is NaN) take the same steps as with overlap off;
* the overlap is real: the first bucket's reduction is issued before the backward pass of
  the first layer (the last one backward computes) has started; with overlap off, after
  (with the distributed optimizer; without it in the full lane).

The groups train only the layouts the session's tests use.
"""

import functools
import hashlib
import os

import pytest
import torch

from depthmix.testing import gather_full, variant_cases, variant_run

from layouts import full_except
from run_harness import FaultyData, Recorder, make_run, spawn, train

pytestmark = pytest.mark.multiproc

MIXERS = {test_id: (mixer, variant) for test_id, mixer, variant in variant_cases("parity")
          if test_id in ("vanilla", "mhc-n2", "attnres_block-bs2")}
LAYOUTS = {  # name: (world size, parallel options)
    "dp2": (2, {}),
    "dp2_distopt": (2, {"distributed_optimizer": True}),
    "pp2_dp2_distopt": (4, {"pp": 2, "distributed_optimizer": True}),
    "pp2_vp2_dp2_distopt": (4, {"pp": 2, "vp": 2, "distributed_optimizer": True,
                                "align_param_gather": True}),
    # experts over 2 expert-parallel x 2 expert-data-parallel ranks: their own buckets
    "moe_ep2_dp4_distopt": (4, {"ep": 2, "distributed_optimizer": True}),
}
EXPERTS = dict(num_experts=4, top_k=2, ffn_hidden_size=32, first_dense_layers=1,
               aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
STEPS = 4


def overlap(parallel: dict, on: bool) -> dict:
    gather = on and parallel.get("distributed_optimizer", False)
    return {**parallel, "overlap_grad_reduce": on, "overlap_param_gather": gather}


def _weights_digest(model) -> str:
    from depthmix.megatron_ext.model import unwrap

    flat = torch.cat([p.detach().flatten() for chunk in model for p in unwrap(chunk).parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _parity_run(case: str, parallel: dict, experts: bool = False) -> dict:
    from depthmix.config.schema import MoEConfig
    from depthmix.pretrain.parallelize import destroy_model_parallel
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    run = variant_run(*MIXERS[case])
    run.model.moe = MoEConfig(**EXPERTS) if experts else None
    t = run.train
    t.micro_batch_size, t.global_batch_size, t.lr, t.eval_iters = 2, 8, 1e-2, 1
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    trainer = Trainer(run, data=SyntheticData, callbacks=[])
    out = {"losses": [], "grad_norms": [], "grads": [],
           "wired": (trainer.config.no_sync_func is not None,
                     trainer.config.grad_sync_func is not None,
                     trainer.config.param_sync_func is not None,
                     trainer.model[0].ddp_config.overlap_param_gather)}
    for step in range(STEPS):
        hook = (lambda model: out["grads"].append(gather_full(model))) if step < 2 else None
        result = trainer.train_one_step(after_backward=hook)
        out["losses"].append(result.loss)
        out["grad_norms"].append(result.grad_norm)
    out["eval"] = trainer.evaluate().loss
    # replicas: the ranks of one stage that hold the same experts
    out["weights"] = ((trainer.topo.pp_rank, trainer.topo.ep_rank),
                      _weights_digest(trainer.model))
    del trainer
    destroy_model_parallel()
    return out


def _parity(layouts) -> dict:
    return {(layout, case, on): _parity_run(case, overlap(LAYOUTS[layout][1], on),
                                            experts=layout.startswith("moe_"))
            for layout in layouts for case in MIXERS for on in (False, True)}


class Outcome(Recorder):
    """The recorded steps plus what was skipped and the weights at the end."""

    def post_step(self, trainer, result) -> None:
        super().post_step(trainer, result)
        self.steps[-1]["skipped"] = result.skipped

    def post_train(self, trainer) -> None:
        self.steps.append({"weights": _weights_digest(trainer.model)})


def _health_and_resume(tmp: str) -> dict:
    from depthmix.checkpoint.store import step_dir
    from depthmix.pretrain.callbacks import CheckpointCallback

    distopt = {"distributed_optimizer": True}
    out = {}
    for on in (False, True):
        rec = Outcome()
        train(make_run(steps=5, **overlap(distopt, on)), [rec],
              data=functools.partial(FaultyData, nan_steps=(3,), nan_dp_ranks=(1,)))
        out["skip", on] = rec.steps
        run = make_run(steps=5, **overlap(distopt, on))
        run.train.on_nonfinite, run.train.save_interval = "rollback", 2
        run.train.save_dir = os.path.join(tmp, f"rollback_{on}")
        rec = Outcome()
        train(run, [rec, CheckpointCallback()],
              data=functools.partial(FaultyData, nan_steps=(4,), nan_dp_ranks=(1,)))
        out["rollback", on] = rec.steps
    root = os.path.join(tmp, "resume")
    run = make_run(steps=5, **overlap(distopt, True))
    run.train.save_dir, run.train.save_interval, run.train.keep_last = root, 2, 0
    out["straight"], _ = train(run, [CheckpointCallback()])
    run = make_run(steps=5, **overlap(distopt, True))
    run.train.load_dir, run.train.save_dir = step_dir(root, 2), root + "_resumed"
    out["resumed"], out["resumed_facts"] = train(run, [CheckpointCallback()])
    return out


def _order_of_events(distributed_optimizer: bool, on: bool) -> list:
    """Step 2's collective calls on gradient buckets and the start of each layer's backward,
    in the order they happened on this rank, for the last micro-batch."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    from depthmix.megatron_ext.model import unwrap
    from depthmix.pretrain.parallelize import destroy_model_parallel
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    run = make_run(steps=2, **overlap({"distributed_optimizer": distributed_optimizer}, on))
    run.parallel.ddp_bucket_size = 20_000  # the tiny model in several buckets
    trainer = Trainer(run, data=SyntheticData, callbacks=[])
    trainer.train_one_step()  # Megatron learns the order gradients arrive in
    bucket_of = {b.grad_data.data_ptr(): i for g in trainer.model[0].bucket_groups
                 for i, b in enumerate(g.buckets)}
    # the buffer holds the parameters in reverse order, bucket 0 first
    bucket_of = {ptr: i for i, ptr in enumerate(sorted(bucket_of))}
    events = []

    def spy(real):
        def call(*args, **kwargs):  # records, then runs the real collective
            hit = [a for a in args if torch.is_tensor(a) and a.data_ptr() in bucket_of]
            if hit:
                events.append(f"reduce bucket {bucket_of[hit[-1].data_ptr()]}")
            return real(*args, **kwargs)
        return call

    def on_layer_output(index, module, inputs, output):
        tensors = [v for v in output.values() if torch.is_tensor(v) and v.requires_grad]
        tensors[0].register_hook(lambda grad: events.append(f"backward layer {index}"))

    layers = unwrap(trainer.model[0]).decoder.layers
    handles = [layer.register_forward_hook(functools.partial(on_layer_output, i))
               for i, layer in enumerate(layers)]
    real = torch.distributed.all_reduce, buffers.dist_reduce_scatter_func
    torch.distributed.all_reduce = spy(real[0])
    buffers.dist_reduce_scatter_func = spy(real[1])
    try:
        trainer.train_one_step()
    finally:
        torch.distributed.all_reduce, buffers.dist_reduce_scatter_func = real
        for h in handles:
            h.remove()
    del trainer
    destroy_model_parallel()
    last = f"backward layer {len(layers) - 1}"
    start = len(events) - 1 - events[::-1].index(last)  # the last micro-batch's backward
    return events[start:]


def _world2(tmp: str, layouts: list, orders: list) -> dict:
    out = {"parity": _parity(layouts), **_health_and_resume(tmp)}
    out["order"] = {(d, on): _order_of_events(d, on) for d in orders for on in (False, True)}
    return out


def _world4(layouts: list) -> dict:
    return {"parity": _parity(layouts)}


def _params_run_here(session, test: str, name: str) -> list:
    return [item.callspec.params[name] for item in session.items
            if item.module.__name__ == __name__ and item.originalname == test]


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    """The two groups, each training the layouts this session's tests use."""
    tmp = str(tmp_path_factory.mktemp("overlap"))
    layouts = _params_run_here(request.session, "test_overlap_trains_exactly_as_without",
                               "layout")
    orders = _params_run_here(request.session,
                              "test_first_bucket_is_reduced_before_the_first_layers_backward",
                              "distributed_optimizer")
    two = [name for name in LAYOUTS if LAYOUTS[name][0] == 2 and name in layouts]
    four = [name for name in LAYOUTS if LAYOUTS[name][0] == 4 and name in layouts]
    return {2: spawn(_world2, 2, (tmp, two, orders), timeout=300),
            4: spawn(_world4, 4, (four,), timeout=300) if four else None}


def _exactly_equal(a: dict, b: dict, label: str) -> None:
    assert a["losses"] == b["losses"], f"{label}: losses"
    assert a["grad_norms"] == b["grad_norms"], f"{label}: gradient norms"
    assert a["eval"] == b["eval"], f"{label}: evaluation loss"
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"{label}: step {step + 1} gradient {name}"


@pytest.mark.parametrize("layout", full_except(LAYOUTS, {"dp2_distopt"}))
def test_overlap_trains_exactly_as_without(results, layout):
    world, parallel = LAYOUTS[layout]
    per_rank = results[world]
    for case in MIXERS:
        off, on = (per_rank[0]["parity"][layout, case, o] for o in (False, True))
        label = f"{case}@{layout}"
        pp, distopt = parallel.get("pp", 1) > 1, parallel.get("distributed_optimizer", False)
        assert off["wired"] == (False, False, False, False), label
        assert on["wired"] == (True, True, bool(parallel.get("align_param_gather")),
                               distopt), label
        assert len(set(off["losses"])) == STEPS, label  # training moves
        _exactly_equal(on, off, label)
        for o in (False, True):  # data-parallel replicas hold the same whole weights
            stages = {}
            for rank in per_rank:
                stage, digest = rank["parity"][layout, case, o]["weights"]
                stages.setdefault(stage, set()).add(digest)
            assert all(len(d) == 1 for d in stages.values()), f"{label} overlap={o}"
            assert len(stages) == (2 if pp else 1) * parallel.get("ep", 1)


def test_resume_with_overlap_is_bit_exact(results):
    for rank in results[2]:
        straight, resumed = rank["straight"], rank["resumed"]
        assert rank["resumed_facts"]["start_step"] == 2
        assert [s["step"] for s in resumed] == [3, 4, 5]
        for key in ("loss", "grad_norm", "lr", "consumed", "rng"):
            assert [s[key] for s in resumed] == [s[key] for s in straight[2:]], key


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_nonfinite_policies_act_alike_with_overlap(results, policy):
    steps = {"skip": [1, 2, 3, 4, 5], "rollback": [1, 2, 3, 4, 3, 4, 5]}[policy]
    digests = set()
    for rank in results[2]:
        off, on = rank[policy, False], rank[policy, True]
        assert [s.get("step") for s in on[:-1]] == steps
        assert [s["skipped"] for s in on[:-1]].count("non-finite loss") == 1
        for a, b in zip(off[:-1], on[:-1]):
            assert (a["loss"] == b["loss"] or a["loss"] != a["loss"] and b["loss"] != b["loss"])
            assert (a["skipped"], a["lr"], a["rng"]) == (b["skipped"], b["lr"], b["rng"])
        assert off[-1] == on[-1], f"{policy}: weights at the end"
        digests.add(on[-1]["weights"])
    assert len(digests) == 1  # both replicas


@pytest.mark.parametrize("distributed_optimizer", full_except(
    [False, True], {True}, ids=lambda d: "dp2_distopt" if d else "dp2"))
def test_first_bucket_is_reduced_before_the_first_layers_backward(results, distributed_optimizer):
    """Buckets hold the parameters in reverse order: bucket 0 (the output layer and the last
    layers) is complete long before backward reaches layer 0. With overlap its reduction is
    issued then; without, every reduction waits for the end of backward."""
    for rank in results[2]:
        on = rank["order"][distributed_optimizer, True]
        off = rank["order"][distributed_optimizer, False]
        assert len({e for e in on if e.startswith("reduce")}) >= 3, on
        first_reduce = next(i for i, e in enumerate(on) if e.startswith("reduce"))
        assert on[first_reduce] == "reduce bucket 0", on
        assert first_reduce < on.index("backward layer 0"), on
        assert off.index("backward layer 0") < min(
            i for i, e in enumerate(off) if e.startswith("reduce")), off
