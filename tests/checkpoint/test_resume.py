"""Exact resume (CPU, fp32, gloo): 6 steps straight == 3 steps, stop, resume, 3 steps.

Per layout, from the same seed: A trains 6 steps straight, saving at steps 3 and 6; B
starts from A's step-3 checkpoint in a fresh Trainer and trains to 6. Compared exactly
(``==``), per rank: B's losses, grad norms, learning rates, loss scales and data position
at steps 4-6 with A's, and one draw from every random generator after each step (Python,
NumPy, torch, Megatron's model-parallel tracker: if any were not restored, B would draw
A's step-1 values). Also at one rank in fp16 with dynamic loss scaling. At one rank, A
also equals a run without any checkpointing (saving does not perturb training), and a run
stopped by ``train.exit_after_steps=3`` saves the step it stopped at.

Resharding: checkpoints saved at TP=2 and PP=2 load at one rank, distributed-optimizer
state moves DP=2 -> DP=1 (dp_reshardable) and DP=2 -> TP=2 (fully_reshardable); the next
losses match the original layout's within 1e-5 (relative).

With experts (sigmoid routing with the expert bias, a buffer that moves every step, and a
shared expert): bit-exact at EP=2 with the distributed optimizer (dp_reshardable: the dense
and the experts' optimizer each keyed by their groups); a checkpoint saved at EP=2 resumes at
EP=1 (distributed optimizer, fully_reshardable) and one saved at EP=1 at EP=2 (Adam state
by global expert index); dp_reshardable state at another EP size is refused, naming the
option.
"""

import os

import pytest

from depthmix.checkpoint.store import latest_checkpoint, list_checkpoints, read_meta, step_dir
from depthmix.config.schema import MoEConfig

from run_harness import make_run, spawn, train

pytestmark = pytest.mark.multiproc

LAYOUTS_2 = {  # bit-exact resume at 2 ranks
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
    "dp2_distopt": {"distributed_optimizer": True},
}


EXPERTS = dict(num_experts=4, top_k=2, ffn_hidden_size=32, first_dense_layers=1,
               score_function="sigmoid", expert_bias=True, expert_bias_update_rate=1e-2,
               shared_expert_ffn_hidden_size=32, aux_loss_coeff=1e-2)
"""DeepSeek-V3's routing on the tiny model (tests/parallel/test_parity.py's)."""

# fp16 with dynamic loss scaling, tuned so that the 6 steps grow the scale, overflow (skipped
# steps), shrink it and step again: the scaler's state must survive the checkpoint
FP16 = {"precision": "fp16", "initial_loss_scale": 2.0**19, "loss_scale_window": 2}


def _make(parallel: dict, train_options: dict = None, experts: bool = False):
    run = make_run(**parallel)
    for key, value in (train_options or {}).items():
        setattr(run.train, key, value)
    if experts:
        run.model.moe = MoEConfig(**EXPERTS)
    return run


def _ab(parallel: dict, root: str, train_options: dict = None, experts: bool = False,
        resume: bool = True) -> dict:
    """A: 6 steps saving at 3 and 6; B (unless not ``resume``): from A's step 3 to 6."""
    from depthmix.pretrain.callbacks import CheckpointCallback

    def make():
        return _make(parallel, train_options, experts)

    run_a = make()
    run_a.train.save_dir, run_a.train.save_interval, run_a.train.keep_last = root, 3, 0
    a, a_facts = train(run_a, [CheckpointCallback()])
    if not resume:
        return {"A": a, "A_facts": a_facts}
    run_b = make()
    run_b.train.load_dir = step_dir(root, 3)
    run_b.train.save_dir = root + "_resumed"
    b, b_facts = train(run_b, [CheckpointCallback()])
    return {"A": a, "B": b, "A_facts": a_facts, "B_facts": b_facts}


def _world2(tmp: str) -> dict:
    from depthmix.pretrain.callbacks import CheckpointCallback

    out = {name: _ab(parallel, os.path.join(tmp, name)) for name, parallel in LAYOUTS_2.items()}
    # distributed-optimizer state saved fully_reshardable at DP=2 moves to TP=2 (DP=1)
    root = os.path.join(tmp, "dp2_distopt_full")
    out["dp2_distopt_full"] = _ab({"distributed_optimizer": True}, root,
                                  {"ckpt_optim_format": "fully_reshardable"})
    run = make_run(tp=2, sequence_parallel=True, distributed_optimizer=True)
    run.train.load_dir = step_dir(root, 3)
    run.train.save_dir = os.path.join(tmp, "dp2_full_to_tp2")
    out["dp2_full_to_tp2"], _ = train(run, [CheckpointCallback()])
    out.update(_experts(tmp))
    return out


def _experts(tmp: str) -> dict:
    """Two ranks with experts: EP=2 bit-exact, EP=2 -> EP=1 and EP=1 -> EP=2."""
    from depthmix.config.schema import ConfigError
    from depthmix.pretrain.callbacks import CheckpointCallback
    from depthmix.pretrain.parallelize import destroy_model_parallel

    ep2, distopt = {"ep": 2, "distributed_optimizer": True}, {"distributed_optimizer": True}
    full = {"ckpt_optim_format": "fully_reshardable"}
    out = {"moe_ep2_distopt": _ab(ep2, os.path.join(tmp, "moe_ep2_distopt"), experts=True)}
    sources = {  # name: (saved at, loaded at, train options)
        "moe_ep2_full": (ep2, distopt, full),  # EP=2 -> EP=1, distributed optimizer
        "moe_ep1": ({}, {"ep": 2}, None),  # EP=1 -> EP=2, Adam state
    }
    for name, (saved, loaded, options) in sources.items():
        out[name] = _ab(saved, os.path.join(tmp, name), options, experts=True, resume=False)
        run = _make(loaded, options, experts=True)
        run.train.load_dir = step_dir(os.path.join(tmp, name), 3)
        run.train.save_dir = os.path.join(tmp, f"{name}_resharded")
        out[f"{name}_resharded"], _ = train(run, [CheckpointCallback()])
    # dp_reshardable state does not move to another EP size
    run = _make(distopt, experts=True)
    run.train.load_dir = step_dir(os.path.join(tmp, "moe_ep2_distopt"), 3)
    run.train.save_dir = os.path.join(tmp, "moe_refused")
    try:
        train(run)
    except ConfigError as e:
        out["moe_refused"] = str(e)
        destroy_model_parallel()
    return out


def _world1(tmp: str) -> dict:
    from depthmix.pretrain.callbacks import CheckpointCallback

    out = {"single": _ab({}, os.path.join(tmp, "single"))}
    out["fp16"] = _ab({}, os.path.join(tmp, "fp16"), FP16)
    out["plain"], _ = train(make_run())
    run = make_run()
    run.train.save_dir, run.train.exit_after_steps = os.path.join(tmp, "stopped"), 3
    out["stopped"], out["stopped_facts"] = train(run, [CheckpointCallback()])
    # dp_reshardable distributed-optimizer state: DP=2 -> DP=1
    run = make_run(distributed_optimizer=True)
    run.train.load_dir = step_dir(os.path.join(tmp, "dp2_distopt"), 3)
    run.train.save_dir = os.path.join(tmp, "dp2_distopt_to_single")
    out["dp2_distopt_to_single"], _ = train(run, [CheckpointCallback()])
    for source in ("tp2_sp", "pp2"):
        run = make_run()
        run.train.load_dir = step_dir(os.path.join(tmp, source), 3)
        run.train.save_dir = os.path.join(tmp, f"{source}_to_single")
        out[f"{source}_to_single"], _ = train(run, [CheckpointCallback()])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("resume"))
    per_rank2 = spawn(_world2, 2, (tmp,), timeout=720)
    per_rank1 = spawn(_world1, 1, (tmp,), timeout=240)
    return {"world2": per_rank2, "world1": per_rank1, "tmp": tmp}


KEYS = ("loss", "grad_norm", "lr", "loss_scale", "consumed", "rng")


def _assert_exact(res: dict, label: str) -> None:
    a, b = res["A"], res["B"]
    assert [s["step"] for s in a] == [1, 2, 3, 4, 5, 6], label
    assert res["B_facts"]["start_step"] == 3 and res["B_facts"]["resumed_from"], label
    assert [s["step"] for s in b] == [4, 5, 6], label
    for key in KEYS:
        assert [s[key] for s in b] == [s[key] for s in a[3:]], f"{label}: {key} after resume"
    # different data each step and moving generators: equality is not trivial
    assert len({s["loss"] for s in a}) == 6 and len({s["rng"] for s in a}) == 6


def test_single_rank_resume_is_bit_exact(results):
    world1 = results["world1"][0]
    _assert_exact(world1["single"], "single")
    for key in KEYS:  # saving every 3 steps changes nothing
        assert [s[key] for s in world1["single"]["A"]] == [s[key] for s in world1["plain"]], key


def test_fp16_loss_scaler_resumes_exactly(results):
    res = results["world1"][0]["fp16"]
    _assert_exact(res, "fp16")
    scales = [s["loss_scale"] for s in res["A"]]
    skipped = [s["grad_norm"] is None for s in res["A"]]
    assert len(set(scales)) >= 3 and any(skipped) and not all(skipped), (scales, skipped)


def test_stop_saves_the_step_it_stopped_at(results):
    world1 = results["world1"][0]
    assert [s["step"] for s in world1["stopped"]] == [1, 2, 3]
    assert world1["stopped_facts"]["end_step"] == 3
    root = os.path.join(results["tmp"], "stopped")
    assert latest_checkpoint(root) == step_dir(root, 3)


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_two_rank_resume_is_bit_exact(results, layout):
    for rank, per_rank in enumerate(results["world2"]):
        _assert_exact(per_rank[layout], f"{layout} rank {rank}")


def test_expert_parallel_resume_is_bit_exact(results):
    for rank, per_rank in enumerate(results["world2"]):
        _assert_exact(per_rank["moe_ep2_distopt"], f"moe_ep2_distopt rank {rank}")


def test_dp_reshardable_state_stays_at_its_expert_parallel_size(results):
    message = results["world2"][0].get("moe_refused", "")
    assert "tp/pp/vp/ep/expert_tp=(1, 1, 1, 2, 1) to (1, 1, 1, 1, 1)" in message, message
    assert "train.ckpt_optim_format=fully_reshardable" in message


@pytest.mark.parametrize("source,target", [
    ("tp2_sp", "tp2_sp_to_single"), ("pp2", "pp2_to_single"),
    ("dp2_distopt", "dp2_distopt_to_single"), ("dp2_distopt_full", "dp2_full_to_tp2"),
    ("moe_ep2_full", "moe_ep2_full_resharded"), ("moe_ep1", "moe_ep1_resharded"),
])
def test_checkpoint_reshards(results, source, target):
    """TP=2 -> 1, PP=2 -> 1 (model and Adam state), distributed optimizer DP=2 -> 1
    (dp_reshardable) and DP=2 -> TP=2 (fully_reshardable); with experts EP=2 -> 1
    (distributed optimizer, fully_reshardable) and EP=1 -> 2 (Adam state)."""
    original = results["world2"][0][source]["A"]
    world = "world2" if target in results["world2"][0] else "world1"
    resumed = results[world][0][target]
    assert [s["step"] for s in resumed] == [4, 5, 6]
    for got, want in zip(resumed, original[3:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=0), \
            f"{source} -> {target}, step {got['step']}"
        assert got["lr"] == want["lr"]


def test_checkpoint_directory_layout(results):
    root = os.path.join(results["tmp"], "tp2_sp")
    assert latest_checkpoint(root) == step_dir(root, 6)
    assert [s for s, _ in list_checkpoints(root)] == [3, 6]  # keep_last=0 keeps all
    meta = read_meta(step_dir(root, 3))
    assert meta["step"] == 3 and meta["consumed_train_samples"] == 24
    assert meta["layout"]["tp"] == 2 and meta["layout"]["pp"] == 1
    assert not [n for n in os.listdir(root) if n.startswith((".tmp", ".trash"))]


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_memory_estimate_counts_each_ranks_parameters(results, layout):
    from depthmix.mixers import mixer_of
    from depthmix.planning.memory import estimate

    run = make_run(**LAYOUTS_2[layout])
    per_stage = estimate(run, mixer_of(run), world_size=2)
    for per_rank in results["world2"]:
        facts = per_rank[layout]["A_facts"]
        assert per_stage[facts["pp_rank"]].params == facts["params"], layout
