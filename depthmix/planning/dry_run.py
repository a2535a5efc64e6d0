"""``train.dry_run=true``: check a configuration for a given world size and print the plan.

Prints the resolved config, the parallel layout (TP/PP/VP/DP sizes, which layers and
pipeline chunks each PP rank holds, which global ranks form each stage), the parameter
count and the per-rank memory estimate (weights + grads + optimizer, activations at the
pipeline peak, pipeline buffers; see :mod:`depthmix.planning.memory`, which the planner
``depthmix-plan`` also reads), FLOPs per token, and exits.
Nothing is allocated and no process group is created, so it runs on a login node:

    depthmix-train model=3b parallel=tp2_pp4 train=paper train.dry_run=true parallel.world_size=64

``depthmix-train`` (:func:`depthmix.cli.train.dry_run`, and one verdict line per point of a
multirun: :func:`depthmix.cli.overrides.dry_run_verdict`) exits 0 when the configuration can
run at that world size, 2 (with the message naming the option) when it cannot.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from omegaconf import OmegaConf
from tabulate import tabulate

from depthmix.config.load import to_container
from depthmix.config.schema import RunConfig
from depthmix.config.validate import data_parallel_size, expert_data_parallel_size, expert_tp_size
from depthmix.planning import memory
from depthmix.planning.experts import Experts
from depthmix.planning.flops import activated_params, flops_per_token, total_params
from depthmix.planning.shape import Shape
from depthmix.planning.units import fmt_bytes, human


def world_size_of(run: RunConfig, env=os.environ) -> int:
    if run.parallel.world_size is not None:
        return run.parallel.world_size
    return int(env.get("WORLD_SIZE", "1"))


def report(run: RunConfig, mixer, world_size: int, out: TextIO = sys.stdout) -> None:
    """The dry run of ``run`` and its ``mixer`` (:class:`~depthmix.mixers.base.Mixer`) at
    ``world_size``: the resolved config, the layout, memory per rank, parameters and FLOPs."""
    p, t = run.parallel, run.train
    dp = data_parallel_size(run, world_size)
    vp = p.vp or 1
    w = out.write
    w("# depthmix dry run: resolved config\n")
    w(OmegaConf.to_yaml(OmegaConf.create(to_container(run))))
    w("\n# parallel layout\n")
    w(f"world size {world_size} = tp {p.tp} x pp {p.pp} x dp {dp}"
      f"{f' (vp {vp} virtual stages per pipeline rank)' if vp > 1 else ''}; "
      f"sequence_parallel={p.sequence_parallel}, distributed_optimizer="
      f"{p.distributed_optimizer}, recompute={p.recompute}\n")
    experts = run.model.experts
    if experts is not None:
        edp = expert_data_parallel_size(run, world_size)
        w(f"experts: world size {world_size} = pp {p.pp} x expert_tp {expert_tp_size(p)} x ep "
          f"{p.ep} x expert dp {edp}; {experts.num_experts // p.ep} of "
          f"{experts.num_experts} experts per rank\n")
    num_micro = t.global_batch_size // (t.micro_batch_size * dp)
    w(f"global batch {t.global_batch_size} = micro batch {t.micro_batch_size} x "
      f"{num_micro} micro-batches x dp {dp}; {t.global_batch_size * run.model.seq_length:,} "
      "tokens per step\n")
    shape = Shape.of(run)  # what the mixer's hooks read, built once
    estimates = memory.estimate(run, mixer, world_size, shape)
    for e in estimates:
        parts = []
        for c in e.chunks:
            tag = "+".join(x for x, on in (("embedding", c["embedding"]), ("head", c["head"]))
                           if on)
            parts.append(f"chunk {c['chunk']}: layers {c['layers'].start}-"
                         f"{c['layers'].stop - 1}" + (f" + {tag}" if tag else ""))
        w(f"  pp rank {e.pp_rank} (global ranks {e.global_ranks}): {'; '.join(parts)}\n")
    w("\n# per-rank memory estimate (one TP x DP rank of each stage)\n")
    rows = [[str(e.pp_rank), human(e.params), _gib(e.state_bytes), _gib(e.activation_bytes),
             str(e.inflight_microbatches), _gib(e.total_bytes),
             fmt_bytes(e.payload_bytes, "MiB", digits=1) if e.payload_bytes else "-",
             _gib(e.p2p_buffer_bytes)] for e in estimates]
    w(tabulate(rows, ["pp rank", "params", "weights+grads+optim", "activations", "in flight",
                      "total", "sends/micro-batch", "p2p buffers"],
               tablefmt="plain", stralign="right", disable_numparse=True) + "\n")
    if run.model.experts:
        _experts(run, estimates, dp, w)
    total = total_params(run, mixer, shape)
    per_param = memory.state_bytes_per_param(t.precision, p.distributed_optimizer, dp)
    activated = activated_params(run, mixer, shape)
    active = (f", {human(activated)} ({activated:,}) activated per token"
              if activated != total else "")
    w(f"model parameters: {human(total)} ({total:,}){active}; bytes/param for weights+grads+"
      f"optimizer: {sum(per_param.values()):.2f} ({t.precision}"
      f"{', distributed optimizer' if p.distributed_optimizer else ''})\n")
    flops = flops_per_token(run, mixer, shape)
    vanilla = flops["linear"] + flops["attention"] + flops["head"]
    swa = f" + short_swa {human(flops['short_swa'])}" if flops["short_swa"] else ""
    extra = flops["mixer"] + flops["short_swa"]
    moe = ""
    if flops["moe"]:
        e = run.model.experts
        shared = ", shared expert" if e.shared_expert_ffn_hidden_size else ""
        moe = f" (MoE layers {human(flops['moe'])}: router, top-{e.top_k} experts{shared})"
    w(f"training FLOPs per token: {human(flops['train'])} (3 x forward; forward = linear "
      f"{human(flops['linear'])}{moe} + attention {human(flops['attention'])} + head "
      f"{human(flops['head'])} + mixer {human(flops['mixer'])}{swa}; "
      f"+{100 * extra / vanilla:.2f}% over vanilla)\n")
    w(f"Estimates (depthmix.planning.memory) exclude the CUDA context, NCCL buffers and "
      f"fragmentation: keep about {memory.RESERVE_GIB:.0f} GiB a device free for them.\n")


def _experts(run: RunConfig, estimates, dp: int, w) -> None:
    """The MoE memory of each rank: the routed experts it holds and their state, what its
    MoE layers save at a balanced router and what routing at its bound would add."""
    e, p = run.model.experts, run.parallel
    moe = Experts.of(run)
    bound = ("dropless: every token of the EP group sent to one rank's experts" if e.dropless
             else f"model.moe.capacity_factor={e.capacity_factor}: every expert full")
    w(f"\n# experts per rank: {sum(moe.moe_layers)} MoE layers of {e.num_experts} experts "
      f"(top-{e.top_k}), {e.num_experts // p.ep} on each of ep {p.ep} ranks, their "
      f"gradients and optimizer state over the expert-data-parallel group of {dp // p.ep}; "
      f"MoE activations at a balanced router, and what routing at its bound adds "
      f"({bound})\n")
    rows = [[str(r.pp_rank), human(r.expert_params), _gib(r.expert_state_bytes),
             _gib(r.moe_activation_bytes), "+" + _gib(r.routing_bound_bytes)]
            for r in estimates]
    w(tabulate(rows, ["pp rank", "expert params", "their weights+grads+optim",
                      "MoE activations", "at the routing bound"],
               tablefmt="plain", stralign="right", disable_numparse=True) + "\n")


def _gib(n: float) -> str:
    return fmt_bytes(n, "GiB")
