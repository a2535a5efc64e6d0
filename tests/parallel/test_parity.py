"""Every mixer at every parallel layout reproduces the single-rank run (CPU, gloo, fp32),
with dense MLPs and with experts.

Each (case, layout) trains 3 steps in real processes (real Megatron parallel state, real
P2P and all-to-all; one group of processes per world size) from the same seed, which gives
the same initial weights at every layout. Dense: every mixer at TP2 x PP2 with sequence
parallelism by default (tensor, sequence and pipeline parallelism at once), the other
layouts in the full lane. Experts (``model.moe``, dropless): every dense layout and the
expert-parallel ones, one mixer per four-rank expert-parallel layout by default (EP x
expert-DP with the distributed optimizer, EP x PP, EP x PP x VP, TP + SP with expert TP 2
and with expert TP 1); in the full lane every case at EP2 x DP2, EP2 x PP2, TP2 + SP and
DP2 + the distributed optimizer, and two cases a layout at the others, in a rotation.
Compared with one rank: the 3 losses (relative 1e-5) and the gradients after step 1,
relative to the gradient norm: the whole gradient and every parameter's error within 1e-5
of the global norm. (Not each tensor relative to its own norm: a tensor whose gradient is
a near-cancelling sum, e.g. DDL's layer-0 read vector with norm 1e-5, already differs by
1e-4 between fp32 and fp64 on one rank.) With experts also the gradient norms (relative
1e-5) and step 1's expert load: the tokens each expert took, exactly, and the balance and
z-losses (relative 1e-5).
"""


import pytest
import torch

from depthmix.config.schema import MoEConfig
from depthmix.testing import assert_same_training, run_layouts, variant_cases, variant_run

from layouts import full_except

pytestmark = pytest.mark.multiproc

# case id -> (mixer, Variant): each mixer's ``parity`` variants, options that make it send
# more than the bare minimum across stages (and ShortSWA, an option of every mixer).
CASES = {test_id: (mixer, variant) for test_id, mixer, variant in variant_cases("parity")}

# name: (world size, parallel options)
LAYOUTS = {
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2}),
    "pp2_vp2": (2, {"pp": 2, "vp": 2}),
    "dp2_distopt": (2, {"distributed_optimizer": True}),
    "tp2_pp2": (4, {"tp": 2, "pp": 2, "sequence_parallel": True}),
    "recompute": (1, {"recompute": "full"}),
}
EP_LAYOUTS = {  # the experts' grid: expert_tp x ep x expert data parallel
    "ep2_dp2": (2, {"ep": 2}),
    "tp2_sp_etp1": (2, {"tp": 2, "sequence_parallel": True, "expert_tp": 1}),  # expert DP 2
    "tp2_sp_ep2": (2, {"tp": 2, "sequence_parallel": True, "ep": 2, "expert_tp": 1}),
    "ep2_dp4_distopt": (4, {"ep": 2, "distributed_optimizer": True}),  # expert DP 2
    "ep2_pp2": (4, {"ep": 2, "pp": 2}),
    "ep2_pp2_vp2": (4, {"ep": 2, "pp": 2, "vp": 2}),
    "tp2_sp_ep2_dp2": (4, {"tp": 2, "sequence_parallel": True, "ep": 2}),  # expert TP 2
    "tp2_sp_pp2_ep2": (4, {"tp": 2, "sequence_parallel": True, "pp": 2, "ep": 2,
                           "expert_tp": 1}),
}
"""Layouts with an expert grid of their own: with experts only."""
ALL_LAYOUTS = {"single": (1, {}), **LAYOUTS, **EP_LAYOUTS}
MIXERS = list(CASES)
DEFAULT = {"tp2_pp2"}
"""The default lane's layout."""

EXPERTS = {
    # tiny_moe's routing: softmax top-2, the balance and z-losses; layers 2-3 (so a PP2
    # stage holds no experts)
    "softmax": dict(num_experts=4, top_k=2, ffn_hidden_size=32, first_dense_layers=2,
                    aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
    # kimi_moe_small's and deepseek_moe_small's: sigmoid with the expert bias (moved after
    # each step), a shared expert, DeepSeek-V3's scaling and sequence-wise balance loss
    "sigmoid": dict(num_experts=4, top_k=2, ffn_hidden_size=32, first_dense_layers=1,
                    score_function="sigmoid", expert_bias=True, shared_expert_ffn_hidden_size=32,
                    routed_scaling_factor=2.5, aux_loss_coeff=1e-3, aux_loss_scope="sequence"),
}
SIGMOID = ("attnres_block", "attnres_full", "mhc", "ddl")
"""Mixers whose expert cases route by sigmoid (Block AttnRes as Kimi, mHC as DeepSeek) and
step through the fused optimizer (its gradient norm over the dense and expert optimizers);
the others route as tiny_moe and step through Megatron's."""
MOE_CASES = [f"moe-{case}" for case in CASES]
MOE_DEFAULT = {("moe-vanilla", "ep2_pp2"), ("moe-attnres_block-bs2", "ep2_dp4_distopt"),
               ("moe-mhc-n2", "tp2_sp_ep2_dp2"), ("moe-moda-attn_kv-w3", "ep2_pp2_vp2"),
               ("moe-depth_attn-s1", "tp2_sp_pp2_ep2")}
"""The default lane's expert pairs: one mixer per four-rank expert-parallel layout (the
four ranks the dense default already starts)."""
MOE_EVERY_CASE = ("ep2_dp2", "ep2_pp2", "tp2_sp", "dp2_distopt")
"""Full lane: every case at EP2 x DP2, EP2 x PP2, TP2 + SP and DP2 + distributed optimizer;
at each other layout two cases in a rotation (with the default's pairs, every layout sees at
least two mixers, every mixer at least one more layout)."""


def _moe_pairs():
    rotation = [layout for layout in [*LAYOUTS, *EP_LAYOUTS] if layout not in MOE_EVERY_CASE]
    pairs = [(case, layout) for layout in MOE_EVERY_CASE for case in MOE_CASES]
    for i, layout in enumerate(rotation):
        pairs += [(MOE_CASES[(2 * i + k) % len(MOE_CASES)], layout) for k in (0, 1)]
    return sorted(set(pairs) | MOE_DEFAULT)


def make_run(case: str, **parallel):
    experts = case.startswith("moe-")
    mixer, variant = CASES[case.removeprefix("moe-")]
    run = variant_run(mixer, variant)
    run.train.micro_batch_size, run.train.global_batch_size = 2, 8  # 4 micro-batches at DP=1
    run.train.lr = 1e-2
    if experts:
        routing = "sigmoid" if mixer in SIGMOID else "softmax"
        run.model.moe = MoEConfig(**EXPERTS[routing])
        run.train.fused_optimizer = "true" if routing == "sigmoid" else "false"
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    return run


def _pairs_run_here(session) -> set:
    """The (case, layout) pairs this session's tests of this file use (all, or those ``-k``
    selects), with their single-rank references."""
    pairs = set()
    for item in session.items:
        if item.module.__name__ == __name__:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            pairs.add((params.get("mixer", "vanilla"), params.get("layout", "pp2")))
    return pairs | {(case, "single") for case, _ in pairs}


RUNS_PER_LAUNCH = 18
"""At most this many runs in one group of processes (one test's time limit)."""


@pytest.fixture(scope="session")
def layout_results(request):
    """``(layout) -> case -> result`` or ``(layout, case) -> result``, with ``"single"`` the
    one-rank reference. The pairs of one world size train in one group of processes,
    Megatron's parallel state rebuilt between runs, up to :data:`RUNS_PER_LAUNCH` at a time:
    the default lane launches once per world size (1, 2 and 4 ranks)."""
    cache = {}

    def get(layout, case=None):
        world = ALL_LAYOUTS[layout][0]
        wanted = [p for p in ((c, layout) for c in ([case] if case else MIXERS))
                  if p not in cache]
        if wanted:  # then the session's other pairs of this world size, this layout's first
            others = sorted((p for p in _pairs_run_here(request.session)
                             if ALL_LAYOUTS[p[1]][0] == world and p not in cache
                             and p not in wanted),
                            key=lambda p: (p[1] != layout, p[1], p[0]))
            todo = wanted + others[:max(0, RUNS_PER_LAUNCH - len(wanted))]
            runs = [make_run(c, **ALL_LAYOUTS[name][1]) for c, name in todo]
            cache.update(zip(todo, run_layouts(runs, world_size=world, timeout=600)))
        if case is not None:
            return cache[case, layout]
        return {m: cache[m, layout] for m in MIXERS}

    return get


def assert_matches(result, ref, label):
    total = assert_same_training(result, ref, label, loss_rtol=1e-5, grad_rtol=1e-5)
    assert total <= 1e-5, f"{label}: gradient err {total:.2e}"
    for name, w_ref in ref["init_params"].items():
        assert torch.equal(result["init_params"][name], w_ref), \
            f"{label}: initial {name} differs across layouts"
    return total


@pytest.mark.parametrize("layout", full_except(LAYOUTS, DEFAULT))
@pytest.mark.parametrize("mixer", MIXERS)
def test_layout_matches_single_rank(mixer, layout, layout_results):
    """Losses and gradients of ``mixer`` at ``layout`` equal the single-rank run."""
    assert_matches(layout_results(layout)[mixer], layout_results("single")[mixer],
                   f"{mixer}@{layout}")


@pytest.mark.parametrize("mixer, layout", [
    pytest.param(case, layout, id=f"{case}-{layout}",
                 marks=() if (case, layout) in MOE_DEFAULT else pytest.mark.full)
    for case, layout in _moe_pairs()])
def test_experts_match_single_rank(mixer, layout, layout_results):
    """With experts: losses, gradients (every expert's, gathered from its expert-parallel
    rank), gradient norms and the expert load equal the single-rank run."""
    import math

    label = f"{mixer}@{layout}"
    result, ref = layout_results(layout, mixer), layout_results("single", mixer)
    assert_matches(result, ref, label)
    for step, (a, b) in enumerate(zip(result["grad_norms"], ref["grad_norms"])):
        assert math.isclose(a, b, rel_tol=1e-5), f"{label}: grad norm step {step + 1}: {a} vs {b}"
    load, ref_load = result["experts"], ref["experts"]
    assert load.layers == ref_load.layers
    assert load.tokens == ref_load.tokens and load.assigned == ref_load.assigned, label
    for name in ("aux_loss", "z_loss"):
        ours, theirs = getattr(load, name), getattr(ref_load, name)
        assert (ours is None) == (theirs is None), f"{label}: {name}"
        for u in (theirs or {}):
            assert math.isclose(ours[u], theirs[u], rel_tol=1e-5), \
                f"{label}: {name} layer {u}: {ours[u]} vs {theirs[u]}"


@pytest.mark.parametrize("layout", full_except(["pp2", "pp2_vp2", "tp2_pp2"], DEFAULT))
@pytest.mark.parametrize("mixer", MIXERS)
def test_bytes_sent_follow_the_plan(mixer, layout, layout_results):
    """Payload bytes each chunk packed = the transport's per-transition formula."""
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.mixers import mixer_of
    from depthmix.planning.pipeline import PipelineLayout, geometry_of

    world, parallel = LAYOUTS[layout]
    run = make_run(mixer, **parallel)
    config = to_transformer_config(run)
    p = run.parallel
    geo = geometry_of(mixer_of(run).plan, config,
                      PipelineLayout(config.num_layers, p.pp, p.vp or 1), p.tp)
    steps, micro = 3, run.train.micro_batch_size
    num_micro = run.train.global_batch_size // micro
    measured = layout_results(layout)[mixer]["bytes_sent"]
    for chunk in range(geo.layout.num_chunks - 1):
        expected = steps * num_micro * geo.payload_bytes(chunk + 1, micro, 4)
        assert measured[chunk] == expected, f"chunk {chunk}: {measured[chunk]} != {expected}"


@pytest.mark.full
def test_vanilla_bytes_closed_form(layout_results):
    """Vanilla sends exactly the hidden state: s * b * h * 4 bytes per micro-batch."""
    run = make_run("vanilla", pp=2)
    m, t = run.model, run.train
    per_micro = m.seq_length * t.micro_batch_size * m.hidden_size * 4
    assert layout_results("pp2")["vanilla"]["bytes_sent"][0] == 3 * 4 * per_micro
