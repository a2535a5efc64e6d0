"""Tensor names and layouts: our single-rank model <-> Hugging Face Qwen3 / Llama.

Megatron fuses what ``transformers`` keeps apart: ``linear_qkv`` holds, per KV group, its
``G`` query heads, then the key head, then the value head (``[ng * (G + 2) * d_h, d]``);
the SwiGLU ``linear_fc1`` holds the gate rows, then the up rows. The embedding and output
layer have ``model.padded_vocab_size`` rows, Hugging Face's ``vocab_size``: padding rows are
zero on import and dropped on export. With ``model.tie_embeddings`` there is no output
layer of our own and no ``lm_head.weight`` (``save_pretrained`` drops tied copies).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, Tuple

import torch

from depthmix.config.schema import ConfigError, ModelConfig
from depthmix.hf.names import (
    EMBEDDING, FINAL_NORM, HF_EMBEDDING, HF_FINAL_NORM, HF_OUTPUT, OUTPUT, layer_names,
)

Tensors = Dict[str, torch.Tensor]


def _group_size(model: ModelConfig) -> Tuple[int, int, int]:
    ng = model.num_query_groups
    return ng, model.num_attention_heads // ng, model.kv_channels


def to_hf(params: Tensors, model: ModelConfig) -> Tensors:
    """Our single-rank weights (``named_parameters`` names) under Hugging Face's names;
    every parameter is used once (a :class:`ConfigError` lists those with no place)."""
    used = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return params[name]

    ng, G, hd = _group_size(model)
    vocab = model.vocab_size
    out = {HF_EMBEDDING: take(EMBEDDING)[:vocab], HF_FINAL_NORM: take(FINAL_NORM)}
    if not model.tie_embeddings:
        out[HF_OUTPUT] = take(OUTPUT)[:vocab]
    for i in range(model.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = take(src + "self_attention.linear_qkv.weight").view(ng, G + 2, hd, -1)
        gate, up = take(src + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out.update({
            dst + "self_attn.q_proj.weight": qkv[:, :G].reshape(ng * G * hd, -1),
            dst + "self_attn.k_proj.weight": qkv[:, G].reshape(ng * hd, -1),
            dst + "self_attn.v_proj.weight": qkv[:, G + 1].reshape(ng * hd, -1),
            dst + "mlp.gate_proj.weight": gate,
            dst + "mlp.up_proj.weight": up,
        })
        out.update({dst + theirs: take(src + ours)
                    for ours, theirs in layer_names(model).items()})
    left = sorted(set(params) - used)
    if left:  # a parameter Hugging Face's model has no place for: it would be dropped
        raise ConfigError(f"parameters with no {'Qwen3' if model.qk_layernorm else 'Llama'} "
                          f"counterpart: {left[:4]}{' ...' if len(left) > 4 else ''}")
    return out


def from_hf(get: Callable[[str], torch.Tensor], model: ModelConfig
            ) -> Iterator[Tuple[str, torch.Tensor]]:
    """(our parameter name, tensor) for every weight, one layer at a time (``get(name)``
    reads one Hugging Face tensor), so only one layer is held beside the model."""
    ng, G, hd = _group_size(model)
    rows = model.padded_vocab_size

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])]) \
            if rows > t.shape[0] else t

    yield EMBEDDING, padded(get(HF_EMBEDDING))
    yield FINAL_NORM, get(HF_FINAL_NORM)
    if not model.tie_embeddings:
        yield OUTPUT, padded(get(HF_OUTPUT))
    for i in range(model.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = get(src + "self_attn.q_proj.weight").view(ng, G, hd, -1)
        k = get(src + "self_attn.k_proj.weight").view(ng, 1, hd, -1)
        v = get(src + "self_attn.v_proj.weight").view(ng, 1, hd, -1)
        yield dst + "self_attention.linear_qkv.weight", \
            torch.cat([q, k, v], dim=1).reshape(ng * (G + 2) * hd, -1)
        yield dst + "mlp.linear_fc1.weight", torch.cat(
            [get(src + "mlp.gate_proj.weight"), get(src + "mlp.up_proj.weight")])
        for ours, theirs in layer_names(model).items():
            yield dst + ours, get(src + theirs)
