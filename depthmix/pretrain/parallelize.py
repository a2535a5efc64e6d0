"""Process groups and model construction, applied in one fixed order.

1. ``init_distributed``: the default process group (the launcher's environment, or a world
   of one local process), Megatron's TP/PP/DP groups and the experts' EP/expert-TP/
   expert-DP groups, and the model-parallel RNG seeds.
   Without CUDA it needs the CPU shim: it installs the runtime first where no entry point
   did (:func:`depthmix.runtime.entry_point`).
2. ``build_chunks``: one ``DepthMixModel`` per virtual pipeline stage on this rank, built from
   the mixer the caller hands it (``depthmix.mixers.mixer_of(run)``), sharing a
   depth-state cache -> ``Float16Module`` for bf16/fp16; what evaluation runs (no gradient
   buffers). ``build_model`` (training) wraps them in Megatron DDP (buckets and overlapped
   communication: :mod:`depthmix.pretrain.overlap`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module

from depthmix.config.schema import RunConfig
from depthmix.config.validate import expert_tp_size
from depthmix.megatron_ext.model import build_chunk
from depthmix.megatron_ext.transport import DepthStateCache
from depthmix.pretrain import overlap
from depthmix.pretrain.compile import compile_layers
from depthmix.pretrain.compile import enabled as compile_enabled
from depthmix.runtime import entry_point
from depthmix.runtime.env import free_port


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    vp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep: int = 1
    """Expert-parallel size (the experts' grid: ``expert_tp x ep x`` expert data parallel)."""
    expert_tp: int = 1
    ep_rank: int = 0
    expert_tp_rank: int = 0
    expert_dp_rank: int = 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that sees the loss: last pipeline stage, TP and DP rank 0."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0


@entry_point
def init_distributed(run: RunConfig) -> Topology:
    """Initialise torch.distributed and Megatron's parallel state (idempotent)."""
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ:  # a launcher's world (torchrun, srun): env:// rendezvous
            dist.init_process_group(backend)
        else:  # a plain single process: a world of one
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
    p = run.parallel
    etp = expert_tp_size(p)
    if parallel_state.model_parallel_is_initialized() and (
        parallel_state.get_tensor_model_parallel_world_size() != p.tp
        or parallel_state.get_pipeline_model_parallel_world_size() != p.pp
        or parallel_state.get_virtual_pipeline_model_parallel_world_size() != p.vp
        or parallel_state.get_expert_model_parallel_world_size() != p.ep
        or parallel_state.get_expert_tensor_parallel_world_size() != etp
    ):  # a later job of a multirun in the same process asks for another layout
        destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        # the experts' grid over each stage's ranks: expert_tp x ep x expert-data-parallel
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vp,
            expert_model_parallel_size=p.ep,
            expert_tensor_parallel_size=etp,
        )
    model_parallel_cuda_manual_seed(run.train.seed)
    return Topology(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp=p.tp,
        pp=p.pp,
        dp=parallel_state.get_data_parallel_world_size(),
        vp=p.vp or 1,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        ep=p.ep,
        expert_tp=etp,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        expert_tp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
    )


def destroy_model_parallel() -> None:
    """Megatron's ``destroy_model_parallel`` and the process groups it created: Megatron
    only forgets them (its data-parallel gloo groups aside), and each live gloo group keeps
    a thread that wakes every 10 ms, so a process that re-initialises for another layout
    (a multirun's next job, a test running many layouts) would gather them by the hundred."""
    groups = [g for g in (getattr(parallel_state, "_global_process_group_list", None) or [])
              if g is not None]  # None stands for the default group: it stays
    parallel_state.destroy_model_parallel()
    for group in groups:
        if group in dist.distributed_c10d._world.pg_map:  # not destroyed by Megatron already
            dist.destroy_process_group(group)


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def build_chunks(run: RunConfig, mixer, config, topo: Topology) -> List[torch.nn.Module]:
    """Model chunks of this rank of ``mixer`` (the run's
    :class:`~depthmix.mixers.base.Mixer`), wrapped for mixed precision only: no gradient
    buffers, for evaluation (and :func:`build_model`)."""
    cache = DepthStateCache()
    chunks = []
    for vp_stage in range(topo.vp):
        chunk = topo.pp_rank + vp_stage * topo.pp
        model = build_chunk(
            config, mixer,
            pre_process=chunk == 0,
            post_process=chunk == topo.pp * topo.vp - 1,
            vp_stage=vp_stage if topo.vp > 1 else None,
            cache=cache,
        )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    if compile_enabled(run):  # in place, before the wrappers: see depthmix.pretrain.compile
        compile_layers(chunks, cuda_graphs=run.train.cuda_graphs)
    if config.fp16 or config.bf16:
        chunks = [Float16Module(config, m) for m in chunks]
    return chunks


def build_model(run: RunConfig, mixer, config, topo: Topology) -> List[torch.nn.Module]:
    """Model chunks of this rank, wrapped for mixed precision and data parallelism."""
    chunks = build_chunks(run, mixer, config, topo)
    ddp_config = overlap.ddp_config(run.parallel, topo.dp)
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                disable_bucketing=i > 0)
        for i, m in enumerate(chunks)
    ]
