"""Tensor names of our single-rank model and of Hugging Face's Qwen3 / Llama (no torch):
what :mod:`depthmix.hf.weights` maps, and the check that a checkpoint holds exactly them."""

from __future__ import annotations

from typing import Dict, Tuple

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


def hf_shapes(model: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``model`` holds, with its shape."""
    d, f, hd = model.hidden_size, model.ffn_hidden_size, model.kv_channels
    q, kv = model.num_attention_heads * hd, model.num_query_groups * hd
    out = {HF_EMBEDDING: (model.vocab_size, d), HF_FINAL_NORM: (d,)}
    if not model.tie_embeddings:
        out[HF_OUTPUT] = (model.vocab_size, d)
    per_layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
                 "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
                 "mlp.down_proj.weight": (d, f)}
    if model.qk_layernorm:
        per_layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    for i in range(model.num_layers):
        out.update({f"model.layers.{i}.{n}": shape for n, shape in per_layer.items()})
    return out


def check_names(shapes: Dict[str, Tuple[int, ...]], model: ModelConfig) -> None:
    """Refuse a checkpoint whose tensors (name -> shape) are not exactly ``model``'s (a
    bias, an extra norm, a missing layer, a shape config.json does not give), naming the
    first odd one."""
    names = {n for n in shapes if not n.endswith(IGNORED_SUFFIXES)}
    want = hf_shapes(model)
    extra = sorted(names - set(want) - {HF_OUTPUT})
    if extra:
        why = ("biases do not map onto our bias-free layers" if extra[0].endswith(".bias")
               else "no counterpart in our model")
        raise ConfigError(f"weight {extra[0]}: {why}"
                          + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    missing = sorted(set(want) - names)
    if missing:
        raise ConfigError(f"weight {missing[0]} is missing from the checkpoint"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise ConfigError(
                f"weight {name} has shape {tuple(shapes[name])}, config.json gives {shape} "
                f"(hidden_size={model.hidden_size}, head_dim={model.kv_channels}, "
                f"num_attention_heads={model.num_attention_heads}, num_key_value_heads="
                f"{model.num_query_groups}, intermediate_size={model.ffn_hidden_size}, "
                f"vocab_size={model.vocab_size})")
