"""Which parallel layout should a run use on a given cluster? (``depthmix-plan``:
:mod:`depthmix.cli.plan`)

    depthmix-plan model=3b mixer=moda cluster.gpus=64 cluster.gpu=h100 cluster.nodes=8

Every other override composes the run as ``depthmix-train`` would (model, mixer, train
preset, ...). The planner enumerates tensor/pipeline/virtual/data-parallel sizes, micro
batch, full recomputation, sequence parallelism and the distributed optimizer, and with
experts (``model.moe``) the expert-parallel size (``parallel.ep``: every divisor of the
data-parallel size that divides the experts); keeps the
layouts whose every pipeline rank fits the device memory less a reserve
(:mod:`depthmix.planning.memory`, the dry run's model); and ranks them by one step's time
(:mod:`depthmix.planning.step_time`: compute at an MFU that falls for small GEMMs, a fixed
cost per micro-batch and pipeline stage, the pipeline bubble, TP, the experts' all-to-all,
P2P and the data-parallel communication left exposed by ``parallel.overlap_*``); its
constants, their sources and
the calibration against published layouts (:mod:`depthmix.planning.calibration`) are in
docs/scaling.md. The report (:mod:`depthmix.planning.plan_report`) prints what it assumed
first. Cluster defaults (:data:`GPU_KINDS`) are the device table's peaks, memory
and bandwidths (:mod:`depthmix.planning.hardware`) and the MFU of large GEMM-bound layers;
override any with ``cluster.<field>=``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

from depthmix.config.schema import ConfigError, RunConfig
from depthmix.config.validate import closest, validate
from depthmix.planning import hardware, memory
from depthmix.planning.flops import flops_per_token
from depthmix.planning.step_time import calibrated, step_time
from depthmix.planning.units import GIB, fmt_bytes



@dataclass(frozen=True)
class GpuKind:
    """One node type: a device of :mod:`depthmix.planning.hardware` and the MFU a tuned
    Megatron run of this size reaches (not a peak)."""

    name: str
    memory_gib: float
    peak_tflops: float
    """Dense bf16/fp16 tensor-core peak."""
    mfu: float
    """Achievable model FLOPs utilisation of the compute term."""
    nvlink_gbs: float
    network_gbs: float
    gpus_per_node: int

    @classmethod
    def of(cls, device: hardware.Device, mfu: float) -> "GpuKind":
        return cls(device.name, device.memory_gib, device.tflops["bf16"], mfu,
                   device.nvlink_gbs, device.network_gbs, device.gpus_per_node)


# MFU of large GEMM-bound layers: Megatron-LM README, "up to 47% MFU on H100 clusters";
# Narayanan et al. 2021 (Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM), Table 1: 52% of an A100's peak at 530B-1T parameters.
GPU_KINDS = {"h100": GpuKind.of(hardware.H100, 0.47), "h200": GpuKind.of(hardware.H200, 0.47),
             "a100": GpuKind.of(hardware.A100, 0.52)}


@dataclass
class Cluster:
    """``cluster.*`` overrides of ``depthmix-plan`` (not part of the training config)."""

    gpus: int = 8
    """GPUs of the job."""
    gpu: str = "h100"
    """GPU kind: its memory, bf16 peak, MFU of large layers and bandwidths (h100, h200,
    a100)."""
    nodes: Optional[int] = None
    """Nodes of the job; default ``gpus / 8`` rounded up. Decides which groups cross the
    network."""
    reserve_gib: float = memory.RESERVE_GIB
    """Memory kept free on every GPU (CUDA context, NCCL buffers, fragmentation)."""
    memory_gib: Optional[float] = None
    """Usable memory per GPU; default the GPU kind's."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s per GPU; default the kind's bf16 peak (1979 for H100 FP8)."""
    mfu: Optional[float] = None
    """MFU that large GEMM-bound layers reach; default the kind's (0.47 H100/H200, 0.52
    A100). Smaller micro-batches and widths reach less (docs/scaling.md)."""
    nvlink_gbs: Optional[float] = None
    """GB/s per GPU, one direction, inside a node; default the kind's."""
    network_gbs: Optional[float] = None
    """GB/s per GPU between nodes; default the kind's (its node's NICs over its GPUs)."""
    micro_batch_sizes: tuple = (1, 2, 4, 8)

    def kind(self) -> GpuKind:
        if self.gpu not in GPU_KINDS:
            raise ConfigError(f"cluster.gpu={self.gpu!r} is unknown; choose one of "
                              f"{', '.join(sorted(GPU_KINDS))}{closest(self.gpu, GPU_KINDS)}")
        base = calibrated(GPU_KINDS[self.gpu])  # the measured runs' MFU, where fitted
        given = {f: getattr(self, f) for f in ("memory_gib", "peak_tflops", "mfu",
                                              "nvlink_gbs", "network_gbs")}
        kind = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
        if self.nodes:
            kind = dataclasses.replace(kind, gpus_per_node=-(-self.gpus // self.nodes))
        return kind


@dataclass
class Layout:
    tp: int
    pp: int
    vp: Optional[int]
    dp: int
    micro_batch: int
    recompute: str
    sequence_parallel: bool
    distributed_optimizer: bool
    ep: int = 1
    """Expert-parallel size (1 without experts)."""

    def apply(self, run: RunConfig, gpus: int) -> RunConfig:
        parallel = dataclasses.replace(
            run.parallel, tp=self.tp, pp=self.pp, vp=self.vp, dp=None, ep=self.ep,
            sequence_parallel=self.sequence_parallel,
            distributed_optimizer=self.distributed_optimizer, recompute=self.recompute,
            world_size=gpus)
        train = dataclasses.replace(run.train, micro_batch_size=self.micro_batch)
        return dataclasses.replace(run, parallel=parallel, train=train)

    def overrides(self, gpus: int, experts: bool = False) -> List[str]:
        """``experts``: the model has them (``parallel.ep`` is then part of the layout)."""
        return [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
                f"parallel.vp={'null' if self.vp is None else self.vp}",
                f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
                f"parallel.distributed_optimizer={str(self.distributed_optimizer).lower()}",
                f"parallel.recompute={self.recompute}", f"parallel.world_size={gpus}",
                f"train.micro_batch_size={self.micro_batch}"] \
            + ([f"parallel.ep={self.ep}"] if experts else [])

    def short(self) -> str:
        vp = f" vp{self.vp}" if self.vp else ""
        vp += f" ep{self.ep}" if self.ep > 1 else ""
        flags = [f for f, on in (("sp", self.sequence_parallel),
                                 ("distopt", self.distributed_optimizer),
                                 ("recompute", self.recompute == "full")) if on]
        return (f"tp{self.tp} pp{self.pp}{vp} dp{self.dp} mb{self.micro_batch}"
                + (" " + "+".join(flags) if flags else ""))




@dataclass
class Candidate:
    layout: Layout
    peak_bytes: float  # the fullest pipeline rank
    peak_rank: memory.RankMemory
    seconds: dict  # by TERMS
    tokens_per_step: int

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_seconds


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(run: RunConfig, cluster: Cluster) -> List[Layout]:
    """Every layout the training config accepts at ``cluster.gpus`` (the option checks)."""
    return [lay for lay in candidates(run, cluster)
            if _accepted(lay.apply(run, cluster.gpus), cluster.gpus)]


def candidates(run: RunConfig, cluster: Cluster) -> List[Layout]:
    """Every layout the planner enumerates, before the option checks."""
    m, t, kind = run.model, run.train, cluster.kind()
    experts = m.experts.num_experts if m.experts else 0
    out = []
    for tp in _divisors(min(kind.gpus_per_node, cluster.gpus)):
        if m.num_attention_heads % tp or m.num_query_groups % tp:
            continue
        for pp in _divisors(cluster.gpus // tp):
            if m.num_layers % pp or (pp > 1 and m.n_loops > 1):
                continue
            dp = cluster.gpus // (tp * pp)
            vps = [None] + [v for v in _divisors(m.num_layers // pp) if v > 1 and pp > 1]
            for vp, mb in ((v, b) for v in vps for b in cluster.micro_batch_sizes):
                if t.global_batch_size % (mb * dp):
                    continue
                if vp and (t.global_batch_size // (mb * dp)) % pp:
                    continue
                eps = [ep for ep in _divisors(dp) if experts % ep == 0] if experts else [1]
                for sp in ([False, True] if tp > 1 else [False]):
                    for distopt in ([False, True] if dp > 1 else [False]):
                        for rc, ep in ((r, e) for r in ("none", "full") for e in eps):
                            out.append(Layout(tp, pp, vp, dp, mb, rc, sp, distopt, ep))
    return out


def _accepted(run: RunConfig, gpus: int) -> bool:
    try:
        validate(run, gpus)
    except ConfigError:
        return False
    return True


def evaluate(run: RunConfig, mixer, lay: Layout, cluster: Cluster,
             flops: Optional[float] = None) -> Candidate:
    """One layout's memory peak and step time (``mixer``: the run's
    :class:`~depthmix.mixers.base.Mixer`; ``flops``: training FLOPs per token)."""
    r = lay.apply(run, cluster.gpus)
    flops = flops if flops is not None else flops_per_token(run, mixer)["train"]
    ranks = memory.estimate(r, mixer, cluster.gpus)
    peak = max(ranks, key=lambda x: x.total_bytes)
    seconds = step_time(r, lay, cluster.kind(), ranks, flops, cluster.gpus)
    return Candidate(lay, peak.total_bytes, peak, seconds,
                     r.train.global_batch_size * r.model.seq_length)


class NoFit(Exception):
    """No layout fits; the message says what is short."""


def plan(run: RunConfig, mixer, cluster: Cluster):
    """``(fitting candidates fastest first, every candidate evaluated)`` for ``run`` and its
    ``mixer``; raises :class:`NoFit` naming the shortfall when nothing fits."""
    kind = cluster.kind()
    budget = (kind.memory_gib - cluster.reserve_gib) * GIB
    flops = flops_per_token(run, mixer)["train"]
    everyone = [evaluate(run, mixer, lay, cluster, flops) for lay in layouts(run, cluster)]
    if not everyone:
        raise NoFit(f"no parallel layout of {cluster.gpus} GPUs is valid for this model "
                    f"(heads, layers and train.global_batch_size={run.train.global_batch_size}"
                    " must divide over tp, pp and dp)")
    fitting = sorted((c for c in everyone if c.peak_bytes <= budget),
                     key=lambda c: (c.step_seconds, c.peak_bytes))
    if not fitting:
        best = min(everyone, key=lambda c: c.peak_bytes)
        p = best.peak_rank
        raise NoFit(
            f"fits on no layout of {cluster.gpus} x {kind.name} ({kind.memory_gib:.1f} GiB, "
            f"{cluster.reserve_gib:.1f} GiB reserve): the smallest need is "
            f"{gib(best.peak_bytes)} on pp rank {p.pp_rank} of {best.layout.short()} "
            f"(weights+grads+optimizer {gib(p.state_bytes)}, activations "
            f"{gib(p.activation_bytes)}, pipeline buffers {gib(p.p2p_buffer_bytes)}); "
            f"memory is short by {gib(best.peak_bytes - budget)} per GPU")
    return fitting, everyone


def gib(n: float) -> str:
    """Bytes as GiB with one decimal."""
    return fmt_bytes(n, "GiB", digits=1)
