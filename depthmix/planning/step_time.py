"""One training step's time on a parallel layout: the cost model ``depthmix-plan`` ranks
layouts by (:mod:`depthmix.planning.planner`). Terms, per step, on the slowest rank::

    compute   3 x forward FLOPs x tokens / (gpus x peak x MFU x eta)   (+1 forward with
              full recomputation). eta, the GEMM efficiency of one micro-batch, falls
              when a layer's GEMMs are small:  eta = w / (w + GEMM_HALF_WORK),
              w = b s h (h / tp)  (tokens x hidden x hidden shard of a micro-batch)
    stage     STAGE_SECONDS per micro-batch and model chunk on a rank (launches, the
              schedule, P2P hand-shakes): micro-batches x vp
    bubble    (compute + recompute + stage) x (pp - 1) / (vp x micro-batches)
    tp        per layer and micro-batch 4 all-reduces (2 forward, 2 backward; SP's
              all-gather + reduce-scatter move the same bytes) of b s h e bytes,
              2 (tp - 1) / tp of it per GPU over NVLink (+2 with recompute); not overlapped.
              An MoE layer's experts (expert TP = tp) gather and scatter their k routed
              rows a token instead of the MLP's one: 2 + 2k (+2 for a shared expert),
              +1 + k (+1) with recompute
    a2a       with experts: per MoE layer on the rank and micro-batch, the dispatch and
              combine all-to-alls forward and backward (4; 6 with recompute), each
              sending (ep - 1) / ep of the rank's b s / t x k x h e routed bytes, over
              NVLink when the EP group (tp x ep consecutive ranks) is inside a node,
              else the network; not overlapped
    p2p       per micro-batch and chunk, the transport's wire bytes forward and back, over
              NVLink when neighbouring stages share a node, else the network
    dp        gradient all-reduce 2 (dp - 1) / dp x 4 bytes a parameter, or with the
              distributed optimizer reduce-scatter (4 bytes) + parameter all-gather
              (weight bytes), (dp - 1) / dp each; over the network when the DP group
              spans nodes; the routed experts' over their expert-data-parallel group of
              dp / ep ranks. With ``parallel.overlap_grad_reduce`` the reduction runs in
              buckets during the last micro-batch's backward (Megatron accumulates the
              others locally): exposed = max(last bucket, reduction - that backward).
              With ``parallel.overlap_param_gather`` (distributed optimizer) the gather
              runs during the first micro-batch's forward: exposed = max(first bucket,
              gather - that forward). Buckets: ``max(40M, 1M x dp)`` parameters,
              Megatron's DDP default.

MFU here is what large, GEMM-bound layers reach (:data:`depthmix.planning.planner.GPU_KINDS`);
eta and the stage cost are what make micro-batch 1 and two-layer pipeline stages lose.
Constants and their sources: docs/scaling.md, "The step-time model". Where measured GPU
runs have been fitted (``python tools/gpu_tables.py --calibrate``:
:mod:`depthmix.planning.gpu_runs`), a device's MFU, ``GEMM_HALF_WORK`` and
``STAGE_SECONDS`` are the fitted ones (:func:`constants`; ``cluster.mfu=`` still wins).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from depthmix.config.schema import RunConfig, overlap_at
from depthmix.planning import gpu_runs, memory
from depthmix.planning.experts import Experts
from depthmix.planning.pipeline import PipelineLayout

TERMS = ("compute", "recompute", "stage", "bubble", "tp", "a2a", "p2p", "dp")

GEMM_HALF_WORK = 2.0e9
"""``b s h (h / tp)`` at which a layer's GEMMs run at half the large-GEMM efficiency."""
STAGE_SECONDS = 2.0e-4
"""Fixed cost of one micro-batch's forward and backward through one model chunk."""
BUCKET_PARAMS, BUCKET_PARAMS_PER_DP = 40_000_000, 1_000_000
"""Megatron's DDP bucket: ``max(40M, 1M x dp)`` parameters (``DistributedDataParallel``)."""


@dataclasses.dataclass(frozen=True)
class Constants:
    """The step-time model's constants for one device."""

    gemm_half_work: float = GEMM_HALF_WORK
    stage_seconds: float = STAGE_SECONDS
    mfu: Optional[float] = None
    """Fitted MFU of large GEMMs; None: the GPU kind's (:data:`planner.GPU_KINDS`)."""
    source: str = "defaults, docs/scaling.md"


def constants(device_name: str) -> Constants:
    """The fitted constants of a device (``Device.name``) where measured runs were fitted
    (:func:`depthmix.planning.gpu_runs.fitted`), else the defaults."""
    fit = gpu_runs.fitted(device_name)
    if not fit:
        return Constants()
    return Constants(fit["gemm_half_work"], fit["stage_seconds"], fit["mfu"],
                     f"fitted to {fit['rows']} measured steps, docs/gpu-runs")


def calibrated(kind):
    """A planner GPU kind with its fitted MFU, where there is one."""
    mfu = constants(kind.name).mfu
    return kind if mfu is None else dataclasses.replace(kind, mfu=mfu)


def gemm_efficiency(run: RunConfig, micro_batch: int, tp: int,
                    half_work: float = GEMM_HALF_WORK) -> float:
    m = run.model
    work = micro_batch * m.seq_length * m.hidden_size * m.hidden_size / tp
    return work / (work + half_work)


def bucket_params(run: RunConfig, dp: int) -> int:
    # ``parallel.ddp_bucket_size`` where the config has it (Megatron's --ddp-bucket-size)
    given = getattr(run.parallel, "ddp_bucket_size", None)
    return given or max(BUCKET_PARAMS, BUCKET_PARAMS_PER_DP * dp)


def _exposed(total: float, window: float, bucket: float) -> float:
    return max(min(total, bucket), total - window)


def step_time(run: RunConfig, lay, kind, ranks, flops_per_token: float, gpus: int) -> dict:
    """Seconds per step by :data:`TERMS` (module doc). ``lay``: the planner's layout,
    ``kind``: its GPU kind, ``ranks``: the memory model's pipeline ranks."""
    m, t, p = run.model, run.train, run.parallel
    e = memory.activation_bytes_of(t.precision)
    tokens = t.global_batch_size * m.seq_length
    num_micro = t.global_batch_size // (lay.micro_batch * lay.dp)
    vp = lay.vp or 1
    c = constants(kind.name)
    eta = gemm_efficiency(run, lay.micro_batch, lay.tp, c.gemm_half_work)
    compute = flops_per_token * tokens / (gpus * kind.peak_tflops * 1e12 * kind.mfu * eta)
    recompute = compute / 3 if lay.recompute == "full" else 0.0
    stage = num_micro * vp * c.stage_seconds
    bubble = (compute + recompute + stage) * (lay.pp - 1) / (vp * num_micro)
    layers_here = m.num_layers * m.n_loops // lay.pp
    moe = Experts.of(run)
    moe_here = _moe_layers_per_rank(run, lay) if moe else 0
    again = lay.recompute == "full"
    collectives = layers_here * (4 + 2 * again)
    if moe:  # the MLP's pair of collectives carries k routed rows (+ the shared expert's)
        pair = moe.top_k + (moe.shared_ffn > 0)
        collectives += moe_here * (2 + again) * (pair - 1)
    size = lay.micro_batch * m.seq_length * m.hidden_size * e
    tp = (num_micro * collectives * 2 * (lay.tp - 1) / lay.tp * size
          / (kind.nvlink_gbs * 1e9))
    a2a = 0.0
    if moe and lay.ep > 1:
        sent = moe.alltoall_bytes(lay.micro_batch * m.seq_length, lay.tp, p.sequence_parallel,
                                  lay.ep, e)
        bw = kind.nvlink_gbs if lay.tp * lay.ep <= kind.gpus_per_node else kind.network_gbs
        a2a = num_micro * moe_here * (4 + 2 * again) * sent / (bw * 1e9)
    stage_stride = lay.tp * lay.dp  # Megatron's rank order: tp fastest, pp outermost
    p2p_bw = kind.nvlink_gbs if stage_stride < kind.gpus_per_node else kind.network_gbs
    wire = max(r.wire_bytes for r in ranks)
    p2p = num_micro * vp * 2 * wire / (p2p_bw * 1e9) if lay.pp > 1 else 0.0
    biggest = max(ranks, key=lambda r: r.params)
    dp = _dp_seconds(run, lay, kind, biggest.params - biggest.expert_params,
                     biggest.expert_params, (compute + recompute) / num_micro)
    return {"compute": compute, "recompute": recompute, "stage": stage, "bubble": bubble,
            "tp": tp, "a2a": a2a, "p2p": p2p, "dp": dp}


def _moe_layers_per_rank(run: RunConfig, lay) -> int:
    """MoE layers (unrolled) on the pipeline rank that holds the most."""
    moe, m = Experts.of(run), run.model
    layout = PipelineLayout(m.num_layers, lay.pp, lay.vp or 1)
    per_rank = [0] * lay.pp
    for c in range(layout.num_chunks):
        per_rank[layout.rank_of(c)] += sum(moe.is_moe(i) for i in layout.layers(c))
    return max(per_rank) * m.n_loops


def _dp_seconds(run: RunConfig, lay, kind, params: int, expert_params: int,
                per_micro: float) -> float:
    """Exposed data-parallel communication (module doc); ``params``: the rank's parameters
    but the routed experts', ``expert_params`` those (reduced over ``dp / ep`` ranks);
    ``per_micro``: one micro-batch's forward + backward compute on a rank."""
    if lay.dp == 1:
        return 0.0
    p = run.parallel
    bw = (kind.network_gbs if lay.tp * lay.dp > kind.gpus_per_node else kind.nvlink_gbs) * 1e9
    edp = lay.dp // lay.ep
    share, expert_share = (lay.dp - 1) / lay.dp, (edp - 1) / edp
    # per parameter: fp32 gradients reduce-scattered (all-reduced: twice) and, with the
    # distributed optimizer, weights all-gathered
    grad = 4 if lay.distributed_optimizer else 2 * 4
    weights = memory.state_bytes_per_param(run.train.precision, False, 1)["weights"]
    grad_bytes = params * grad * share + expert_params * grad * expert_share
    reduce = grad_bytes / bw
    total = params + expert_params
    bucket = min(total, bucket_params(run, lay.dp))
    backward = per_micro * 2 / 3
    overlap = overlap_at(p, lay.dp, lay.distributed_optimizer)
    if overlap.grad_reduce:
        reduce = _exposed(reduce, backward, bucket * grad_bytes / total / bw)
    if not lay.distributed_optimizer:
        return reduce
    gather_bytes = (params * share + expert_params * expert_share) * weights
    gather = gather_bytes / bw
    if overlap.param_gather:
        gather = _exposed(gather, per_micro / 3, bucket * gather_bytes / total / bw)
    return reduce + gather
