"""Tensor names and layouts: our single-rank model <-> Hugging Face Qwen3 / Qwen3-MoE / Llama.

Megatron fuses what ``transformers`` keeps apart: ``linear_qkv`` holds, per KV group, its
``G`` query heads, then the key head, then the value head (``[ng * (G + 2) * d_h, d]``);
the SwiGLU ``linear_fc1`` holds the gate rows, then the up rows (the dense MLP, each expert
of ``SequentialMLP`` and the shared expert alike). The embedding and output layer have
``model.padded_vocab_size`` rows, Hugging Face's ``vocab_size``: padding rows are zero on
import and dropped on export. With ``model.tie_embeddings`` there is no output layer of our
own and no ``lm_head.weight`` (``save_pretrained`` drops tied copies).

An MoE layer's router is ``mlp.gate``; expert ``e`` is ``mlp.experts.<e>.{gate,up,down}_proj``
(or row ``e`` of the packed ``mlp.experts.gate_up_proj`` / ``down_proj``, read on import).
The shared expert (``mlp.shared_expert.*``, Qwen2-MoE's name) and the expert bias
(``mlp.gate.e_score_correction_bias``, DeepSeek-V3's) exist only in the remote-code export.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, Tuple

import torch

from depthmix.config.schema import ConfigError, ModelConfig
from depthmix.hf.names import (
    EMBEDDING, EXPERT_BIAS, FINAL_NORM, HF_EMBEDDING, HF_EXPERT_BIAS, HF_FINAL_NORM, HF_OUTPUT,
    HF_ROUTER, HF_SHARED_EXPERT, OUTPUT, PACKED_DOWN, PACKED_GATE_UP, ROUTER, SHARED_EXPERT,
    is_moe_layer, layer_names,
)

Tensors = Dict[str, torch.Tensor]
Pairs = Iterator[Tuple[str, str]]


def _group_size(model: ModelConfig) -> Tuple[int, int, int]:
    ng = model.num_query_groups
    return ng, model.num_attention_heads // ng, model.kv_channels


def swiglu_names(model: ModelConfig, layer: int) -> Pairs:
    """``(our SwiGLU prefix, Hugging Face's)`` for every SwiGLU MLP of one layer, under the
    layers' prefixes: the dense MLP, or each expert."""
    if not is_moe_layer(model, layer):
        yield "mlp.", "mlp."
        return
    for e in range(model.experts.num_experts):
        yield f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}."


def to_hf(params: Tensors, model: ModelConfig) -> Tensors:
    """Our single-rank weights (``named_parameters`` names, plus the routers' expert bias
    when given) under Hugging Face's names; every tensor is used once (a
    :class:`ConfigError` lists those with no place)."""
    used = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return params[name]

    def swiglu(src: str, dst: str) -> Tensors:
        gate, up = take(src + "linear_fc1.weight").chunk(2, dim=0)
        return {dst + "gate_proj.weight": gate, dst + "up_proj.weight": up,
                dst + "down_proj.weight": take(src + "linear_fc2.weight")}

    ng, G, hd = _group_size(model)
    vocab = model.vocab_size
    out = {HF_EMBEDDING: take(EMBEDDING)[:vocab], HF_FINAL_NORM: take(FINAL_NORM)}
    if not model.tie_embeddings:
        out[HF_OUTPUT] = take(OUTPUT)[:vocab]
    for i in range(model.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = take(src + "self_attention.linear_qkv.weight").view(ng, G + 2, hd, -1)
        out.update({
            dst + "self_attn.q_proj.weight": qkv[:, :G].reshape(ng * G * hd, -1),
            dst + "self_attn.k_proj.weight": qkv[:, G].reshape(ng * hd, -1),
            dst + "self_attn.v_proj.weight": qkv[:, G + 1].reshape(ng * hd, -1),
        })
        for ours, theirs in swiglu_names(model, i):
            out.update(swiglu(src + ours, dst + theirs))
        if is_moe_layer(model, i):
            out[dst + HF_ROUTER] = take(src + ROUTER)
            if src + EXPERT_BIAS in params:
                out[dst + HF_EXPERT_BIAS] = take(src + EXPERT_BIAS)
            if model.experts.shared_expert_ffn_hidden_size:
                out.update(swiglu(src + SHARED_EXPERT, dst + HF_SHARED_EXPERT))
        out.update({dst + theirs: take(src + ours)
                    for ours, theirs in layer_names(model).items()})
    left = sorted(set(params) - used)
    if left:  # a parameter Hugging Face's model has no place for: it would be dropped
        raise ConfigError(f"parameters with no {'Qwen3' if model.qk_layernorm else 'Llama'} "
                          f"counterpart: {left[:4]}{' ...' if len(left) > 4 else ''}")
    return out


def from_hf(get: Callable[[str], torch.Tensor], model: ModelConfig, packed: bool = False
            ) -> Iterator[Tuple[str, torch.Tensor]]:
    """(our parameter name, tensor) for every weight, one layer at a time (``get(name)``
    reads one Hugging Face tensor), so only one layer is held beside the model. ``packed``:
    the experts are 3-D tensors (:func:`depthmix.hf.names.is_packed`)."""
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
        if is_moe_layer(model, i):
            yield dst + ROUTER, get(src + HF_ROUTER)
        if is_moe_layer(model, i) and packed:  # gate_up_proj[e]: the gate rows, then the up rows
            gate_up, down = get(src + PACKED_GATE_UP), get(src + PACKED_DOWN)
            for e, (ours, _) in enumerate(swiglu_names(model, i)):
                yield dst + ours + "linear_fc1.weight", gate_up[e]
                yield dst + ours + "linear_fc2.weight", down[e]
        else:
            for ours, theirs in swiglu_names(model, i):
                yield dst + ours + "linear_fc1.weight", torch.cat(
                    [get(src + theirs + "gate_proj.weight"), get(src + theirs + "up_proj.weight")])
                yield dst + ours + "linear_fc2.weight", get(src + theirs + "down_proj.weight")
        for ours, theirs in layer_names(model).items():
            yield dst + ours, get(src + theirs)
