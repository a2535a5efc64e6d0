"""Tensor names of our single-rank model and of Hugging Face's Qwen3 / Llama (no torch):
what :mod:`depthmix.hf.weights` maps, and the check that a checkpoint holds exactly them."""

from __future__ import annotations

from typing import Dict, Iterable

from depthmix.config.schema import ConfigError, ModelConfig

# ours (under decoder.layers.<i>.) -> Hugging Face's (under model.layers.<i>.), one to one
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
QK_NORM_NAMES = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
EMBEDDING, OUTPUT, FINAL_NORM = ("embedding.word_embeddings.weight", "output_layer.weight",
                                 "final_layernorm.weight")
HF_EMBEDDING, HF_OUTPUT, HF_FINAL_NORM = "model.embed_tokens.weight", "lm_head.weight", \
    "model.norm.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some older checkpoints saved; recomputed, never loaded."""


def layer_names(model: ModelConfig) -> Dict[str, str]:
    """Ours -> theirs for the weights that map one to one, under each layer's prefix."""
    return {**LAYER_NAMES, **(QK_NORM_NAMES if model.qk_layernorm else {})}


def hf_names(model: ModelConfig) -> set:
    """Every tensor name a Hugging Face checkpoint of ``model`` holds."""
    names = {HF_EMBEDDING, HF_FINAL_NORM} | ({HF_OUTPUT} if not model.tie_embeddings else set())
    per_layer = list(layer_names(model).values()) + [
        f"self_attn.{p}_proj.weight" for p in "qkv"] + ["mlp.gate_proj.weight",
                                                        "mlp.up_proj.weight"]
    for i in range(model.num_layers):
        names.update(f"model.layers.{i}.{n}" for n in per_layer)
    return names


def check_names(names: Iterable[str], model: ModelConfig) -> None:
    """Refuse a checkpoint whose tensors are not exactly ``model``'s (a bias, an extra
    norm, a missing layer), naming the first odd one."""
    names = {n for n in names if not n.endswith(IGNORED_SUFFIXES)}
    want = hf_names(model)
    extra = sorted(names - want - {HF_OUTPUT})
    if extra:
        why = ("biases do not map onto our bias-free layers" if extra[0].endswith(".bias")
               else "no counterpart in our model")
        raise ConfigError(f"weight {extra[0]}: {why}"
                          + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    missing = sorted(want - names)
    if missing:
        raise ConfigError(f"weight {missing[0]} is missing from the checkpoint"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
