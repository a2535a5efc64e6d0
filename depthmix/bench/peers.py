"""Peer models at a depthmix run's shape, for the benchmark tools (``tools/bench_mixers.py
--peers``, ``tools/gpu_bench.py``): Megatron-Core's own ``GPTModel`` (local spec) and Hugging
Face's ``Qwen3ForCausalLM`` (SDPA), both the Qwen3-style decoder our vanilla model is
(RMSNorm, SwiGLU, QK-norm, RoPE, GQA, no biases, untied embeddings), and a round-robin
forward+backward timer for them.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional, Tuple

import torch

from depthmix.config.schema import RunConfig
from depthmix.runtime.precision import torch_dtype

Peer = Tuple[str, torch.nn.Module, Callable]
"""``(name, model, loss_fn(tokens, positions) -> scalar)``."""

def megatron_gpt(run: RunConfig, head_dim: int) -> Peer:
    """Megatron-Core's ``GPTModel`` with its local (non-Transformer-Engine) spec."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    m, dtype = run.model, torch_dtype(run.train.precision)
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=head_dim, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, pipeline_dtype=dtype)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=m.vocab_size,
                   max_sequence_length=m.seq_length, position_embedding_type="rope",
                   share_embeddings_and_output_weights=False).to(dtype)
    return ("megatron GPTModel", gpt,
            lambda x, pos: gpt(x, pos, attention_mask=None, labels=x).sum())


def hf_qwen3(run: RunConfig, head_dim: int) -> Optional[Peer]:
    """Hugging Face's ``Qwen3ForCausalLM`` with SDPA attention, or None when
    ``transformers`` is not installed."""
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except ImportError:
        return None
    m = run.model
    hf = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, head_dim=head_dim,
        max_position_embeddings=m.seq_length, tie_word_embeddings=False,
        attn_implementation="sdpa")).to(torch_dtype(run.train.precision))
    return "HF Qwen3", hf, lambda x, pos: hf(input_ids=x, labels=x).loss


def compile_hf_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer of a Hugging Face model in place, as ``train.compile``
    compiles ours (regional compilation, :mod:`depthmix.pretrain.compile`); returns how many.

    Dynamo's recompile limit is process-wide and ``compile_layers`` sets it to what our
    model's bodies need (a hard failure beyond); a Hugging Face layer specialises on its
    ``layer_idx`` and so compiles one body per layer: the limit is set for that here, after
    a reset, and a peer beyond it falls back to eager as torch's default does."""
    import torch._dynamo

    layers = list(model.model.layers)
    torch._dynamo.reset()
    config = torch._dynamo.config
    config.recompile_limit = max(8, 3 * len(layers))
    config.fail_on_recompile_limit_hit = False
    for layer in layers:
        layer.compile()
    return len(layers)


def peer_models(run: RunConfig, head_dim: int) -> List[Peer]:
    """Megatron-Core's GPTModel (local spec) and, if installed, HF Qwen3 at ``run``'s shape."""
    peers = [megatron_gpt(run, head_dim)]
    hf = hf_qwen3(run, head_dim)
    return peers + ([hf] if hf is not None else [])


def forward_backward_rounds(models: List[Peer], batch, steps: int, warmup: int,
                            clock: Callable[[], float] = time.perf_counter) -> dict:
    """Seconds of forward+backward (no optimizer) of each model in each of ``steps``
    rounds after ``warmup``; a round steps every model once, in turn, so that machine
    drift hits them alike (and a round's ratios compare neighbours in time). ``clock``:
    wall time, or ``time.thread_time`` (this thread's CPU time: what other processes on a
    shared machine barely move; all of the work only with one intra-op thread, on a CPU)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    x, pos = batch
    times = {name: [] for name, _, _ in models}
    for step in range(warmup + steps):
        for name, model, loss_fn in models:
            sync()
            t0 = clock()
            loss_fn(x, pos).backward()
            sync()
            model.zero_grad(set_to_none=True)
            if step >= warmup:
                times[name].append(clock() - t0)
    return times


def time_forward_backward(models: List[Peer], batch, steps: int, warmup: int) -> dict:
    """Median seconds of forward+backward per model (:func:`forward_backward_rounds`)."""
    return {name: statistics.median(t)
            for name, t in forward_backward_rounds(models, batch, steps, warmup).items()}


def round_ratios(times: dict, base: str) -> dict:
    """Per model, the median over rounds of its time over ``base``'s in the same round
    (steadier than the ratio of medians on a machine whose load drifts)."""
    return {name: statistics.median(a / b for a, b in zip(t, times[base]))
            for name, t in times.items()}
