"""What ``depthmix-plan`` prints: what it assumed, the fastest layouts with each step-time
term and why each loser lost, and the chosen layout as ``depthmix-train`` overrides."""

from __future__ import annotations

import dataclasses
import sys
from typing import List, Optional, Sequence, TextIO

from tabulate import tabulate

from depthmix.config.schema import RunConfig, overlap_at
from depthmix.planning import step_time
from depthmix.planning.planner import Candidate, Cluster, evaluate, gib, plan
from depthmix.planning.step_time import TERMS
from depthmix.planning.units import GIB, fmt_bytes


def terms_of(run: RunConfig) -> tuple:
    """The step-time terms the report shows: the all-to-all only with experts."""
    return TERMS if run.model.experts else tuple(k for k in TERMS if k != "a2a")


def why_slower(loser: Candidate, winner: Candidate) -> str:
    if loser.step_seconds <= winner.step_seconds * 1.001:
        return f"same time, {gib(loser.peak_bytes - winner.peak_bytes)} more memory"
    deltas = {k: loser.seconds[k] - winner.seconds[k] for k in TERMS}
    term = max(deltas, key=deltas.get)
    return f"+{deltas[term]:.3f} s {term}"


def _on(flag: Optional[bool], auto: str) -> str:
    return auto if flag is None else ("on" if flag else "off")


def assumptions(run: RunConfig, cluster: Cluster) -> List[str]:
    """The inputs the ranking rests on, each with the option that changes it."""
    kind, m, t, p = cluster.kind(), run.model, run.train, run.parallel
    c = step_time.constants(kind.name)
    nodes = -(-cluster.gpus // kind.gpus_per_node)
    mbs = ", ".join(str(b) for b in cluster.micro_batch_sizes)
    return [
        f"cluster: {cluster.gpus} x {kind.name}, {nodes} node(s) of {kind.gpus_per_node} "
        f"(cluster.gpus, cluster.gpu, cluster.nodes); NVLink {kind.nvlink_gbs:g} GB/s, "
        f"network {kind.network_gbs:g} GB/s per GPU (cluster.nvlink_gbs, cluster.network_gbs)",
        f"batch: {t.global_batch_size} sequences a step (train.global_batch_size) of "
        f"{m.seq_length} tokens (model.seq_length); micro-batches tried: {mbs}",
        f"precision: {t.precision} (train.precision); MFU {kind.mfu:.2f} of "
        f"{kind.peak_tflops:g} TFLOP/s for large GEMM-bound layers (cluster.mfu, "
        f"cluster.peak_tflops)" + (" -- the bf16 peak: an fp32 run is slower, plan with "
                                   "train.precision=bf16 for a cluster run"
                                   if t.precision == "fp32" else ""),
        f"memory: {kind.memory_gib:.1f} GiB per GPU less a {cluster.reserve_gib:.1f} GiB "
        f"reserve (cluster.memory_gib, cluster.reserve_gib)",
        f"step time: GEMM efficiency w / (w + {c.gemm_half_work:.0e}), w = b s h "
        f"(h / tp); {c.stage_seconds * 1e3:.3g} ms per micro-batch and pipeline chunk "
        f"({c.source}); "
        f"DP gradient reduction overlapped with backward: "
        f"{_on(p.overlap_grad_reduce, 'on at DP > 1')} (parallel.overlap_grad_reduce), "
        f"parameter gather with forward: "
        f"{_on(p.overlap_param_gather, 'on with the distributed optimizer')} "
        f"(parallel.overlap_param_gather); TP{', all-to-all' if m.experts else ''} and P2P "
        "communication not overlapped",
    ] + ([experts_assumption(run)] if m.experts else [])


def experts_assumption(run: RunConfig) -> str:
    e = run.model.experts
    return (f"experts: {e.num_experts} routed, top-{e.top_k}; FLOPs count the activated "
            "parameters; parallel.ep searched over the divisors of dp that divide "
            "model.moe.num_experts; memory and the all-to-all at a balanced router")


def experts_line(run: RunConfig, budget: float, chosen: Candidate) -> Optional[str]:
    """With experts: what the chosen layout's MoE layers save, and what routing at its
    bound would add (the plan fits a balanced router)."""
    if not run.model.experts:
        return None
    e, peak = run.model.experts, chosen.peak_rank
    bound = ("every token of the EP group routed to one rank's experts (dropless)"
             if e.dropless else f"every expert at capacity (model.moe.capacity_factor="
             f"{e.capacity_factor})")
    fits = "within" if chosen.peak_bytes + peak.routing_bound_bytes <= budget else "over"
    return (f"experts: the chosen layout's MoE layers save "
            f"{fmt_bytes(peak.moe_activation_bytes)} on pp rank {peak.pp_rank} at a balanced "
            f"router; with {bound} {fmt_bytes(peak.routing_bound_bytes)} more ({fits} the "
            "memory budget)")


def refused_expert_parallel(run: RunConfig, cluster: Cluster) -> Optional[str]:
    """A note when the option checks refused every ``parallel.ep > 1`` layout."""
    from depthmix.config.schema import ConfigError
    from depthmix.config.validate import validate
    from depthmix.planning.planner import candidates

    if not run.model.experts:
        return None
    tried = [lay for lay in candidates(run, cluster) if lay.ep > 1]
    reasons = []
    for lay in tried:
        try:
            validate(lay.apply(run, cluster.gpus), cluster.gpus)
            return None
        except ConfigError as error:
            reasons.append(str(error))
    if not tried:
        return None
    return (f"note: the {len(tried)} layouts with parallel.ep > 1 were refused by the "
            f"option checks ({reasons[0]})")


def small_batch_warning(run: RunConfig, mixer, cluster: Cluster,
                        chosen: Candidate) -> Optional[str]:
    """A warning when the global batch is smaller than one micro-batch per data-parallel
    rank of the layout the planner would choose with a batch of ``gpus x 8`` sequences: the
    batch, not the cluster, then decides the plan."""
    batch = run.train.global_batch_size
    if batch >= cluster.gpus * max(cluster.micro_batch_sizes):
        return None
    larger = cluster.gpus * max(cluster.micro_batch_sizes)
    train = dataclasses.replace(run.train, global_batch_size=larger)
    best = plan(dataclasses.replace(run, train=train), mixer, cluster)[0][0]
    need = best.layout.dp * best.layout.micro_batch
    if need <= batch:
        return None
    return (f"warning: train.global_batch_size={batch} is smaller than one micro-batch per "
            f"data-parallel rank of the best layout for this cluster "
            f"({best.layout.short()}: {need} sequences a step), so the plan is "
            f"{chosen.layout.short()}; pass the train preset you will run (train=paper: "
            f"1024 sequences) or train.global_batch_size")


def overlap_note(run: RunConfig, mixer, cluster: Cluster, chosen: Candidate) -> Optional[str]:
    """What turning on the ``parallel.overlap_*`` options left off would save the chosen
    layout (None: they are on, or would save under 1% of the step)."""
    p, lay = run.parallel, chosen.layout
    now = overlap_at(p, lay.dp, lay.distributed_optimizer)
    off = [f"parallel.{name}=true" for name, on in (
        ("overlap_grad_reduce", now.grad_reduce),
        ("overlap_param_gather", now.param_gather or not lay.distributed_optimizer)) if not on]
    if not off or chosen.layout.dp == 1:
        return None
    parallel = dataclasses.replace(p, overlap_grad_reduce=True, overlap_param_gather=True)
    on = evaluate(dataclasses.replace(run, parallel=parallel), mixer, chosen.layout, cluster)
    saved = chosen.step_seconds - on.step_seconds
    if saved < 0.01 * chosen.step_seconds:
        return None
    return (f"note: {' '.join(off)} would hide {saved:.3f} s of this layout's "
            f"{chosen.seconds['dp']:.3f} s of data-parallel communication (plan again "
            "with them: the ranking can change)")


def measured_lines(run: RunConfig, mixer, cluster: Cluster) -> List[str]:
    """The measured step of this shape beside the planner's prediction for the layout it ran
    at (one GPU, one micro-batch a step), from GPU run files
    (:func:`depthmix.planning.gpu_runs.measured`); empty when none has the shape."""
    from depthmix.planning import gpu_runs
    from depthmix.planning.planner import Layout

    lines = []
    for row in gpu_runs.measured(run, mixer, cluster.gpu, cluster.gpus):
        lay = Layout(1, 1, None, 1, row["micro_batch"], "none", False, False)
        predicted = evaluate(run, mixer, lay, cluster).step_seconds * 1e3
        lines.append(
            f"measured: {lay.short()} {row['mode']} on {row['device']}: "
            f"{row['ms_per_step']:.1f} ms a step ({row['tokens_per_s']:,.0f} tokens/s), "
            f"run file {row['run_file']}; predicted {predicted:.1f} ms "
            f"({predicted / row['ms_per_step']:.2f} x measured)")
    return lines


def report(run: RunConfig, mixer, cluster: Cluster, argv: Sequence[str], top: int = 5,
           out: TextIO = sys.stdout) -> Candidate:
    """The plan of ``run`` and its ``mixer`` (:class:`~depthmix.mixers.base.Mixer`) on
    ``cluster``, written to ``out``; returns the chosen candidate."""
    fitting, everyone = plan(run, mixer, cluster)
    w = out.write
    w(f"# depthmix-plan: {run.model.name} mixer={run.mixer.name} on {cluster.gpus} x "
      f"{cluster.kind().name}\n")
    for line in assumptions(run, cluster):
        w(f"#   {line}\n")
    win = fitting[0]
    warning = small_batch_warning(run, mixer, cluster, win)
    if warning:
        w(f"{warning}\n")
    w(f"{len(everyone)} valid layouts, {len(fitting)} fit memory\n\n")
    terms = terms_of(run)
    rows = [[c.layout.short(), f"{c.step_seconds:.3f}", f"{c.tokens_per_s:,.0f}",
             f"{c.peak_bytes / GIB:.1f}", *[f"{c.seconds[k]:.3f}" for k in terms],
             "chosen" if c is win else why_slower(c, win)] for c in fitting[:top]]
    w(tabulate(rows, ["layout", "step s", "tokens/s", "peak GiB", *terms, "why slower"],
               tablefmt="plain", colalign=("left", *["right"] * (3 + len(terms)), "left"),
               disable_numparse=True) + "\n")
    too_big = [c for c in everyone if c not in fitting]
    if too_big:
        fastest = min(too_big, key=lambda c: c.step_seconds)
        w(f"{len(too_big)} layouts need more than the budget (e.g. "
          f"{fastest.layout.short()}: {gib(fastest.peak_bytes)})\n")
    note = overlap_note(run, mixer, cluster, win)
    if note:
        w(f"{note}\n")
    budget = (cluster.kind().memory_gib - cluster.reserve_gib) * GIB
    for line in (experts_line(run, budget, win), refused_expert_parallel(run, cluster)):
        if line:
            w(f"{line}\n")
    for line in measured_lines(run, mixer, cluster):
        w(f"{line}\n")
    overrides = win.layout.overrides(cluster.gpus, experts=run.model.experts is not None)
    w("\nchosen:\n  depthmix-train " + " ".join([*argv, *overrides]) + "\n")
    return win
