"""Helpers for tests and benchmarks: tiny configs and an in-process single-rank Megatron."""

from __future__ import annotations

import os
import socket
from typing import Optional

import torch

from depthmix import cpu_compat
from depthmix.config.schema import RunConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(seed: int = 1234) -> None:
    """World size 1 with gloo and Megatron's parallel state at TP=PP=1 (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu_compat.activate()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed)


def tiny_run(mixer: str = "vanilla", **mixer_options) -> RunConfig:
    """A 4-layer, 64-wide GQA (G=2) model on 16-token sequences; fp32."""
    from depthmix.megatron_ext.mixers import get_mixer

    run = RunConfig()
    m = run.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 4, 64, 160
    m.num_attention_heads, m.num_query_groups = 4, 2
    m.vocab_size, m.make_vocab_size_divisible_by, m.seq_length = 128, 64, 16
    run.mixer = get_mixer(mixer).config_cls(name=mixer, **mixer_options)
    run.mixer.resolve(run.model)
    run.train.precision = "fp32"
    return run


def build_model(run: RunConfig, dtype: Optional[torch.dtype] = None):
    """Build the whole model on one rank (call :func:`init_single_process` first)."""
    from depthmix.config.megatron import to_transformer_config
    from depthmix.config.validate import validate
    from depthmix.megatron_ext.model import DepthMixModel

    validate(run)
    model = DepthMixModel(to_transformer_config(run))
    return model.to(dtype) if dtype is not None else model


@torch.no_grad()
def incremental_logits(model, input_ids: torch.Tensor, prefill: int = 1) -> torch.Tensor:
    """Logits ``[b, s, v]`` from a prefill of ``prefill`` tokens then one token at a time
    through the KV cache; must equal ``model(input_ids)``."""
    from depthmix.inference import KVCache

    cache = KVCache()
    outs = [model(input_ids[:, :prefill], inference=cache)]
    cache.advance(prefill)
    for t in range(prefill, input_ids.shape[1]):
        outs.append(model(input_ids[:, t : t + 1], inference=cache))
        cache.advance(1)
    return torch.cat(outs, dim=1)
