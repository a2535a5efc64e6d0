"""Tensor names of our single-rank model and of Hugging Face's Qwen3 / Qwen3-MoE / Llama (no
torch): what :mod:`depthmix.hf.weights` maps, and the check that a checkpoint holds exactly
them.

Qwen3-MoE files hold each expert apart (``mlp.experts.<e>.gate_proj.weight``, ...: what
``save_pretrained`` writes, transformers 4 and 5 alike; 5 packs them into 3-D tensors in
memory only); a file with the packed tensors (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) is read too."""

from __future__ import annotations

from typing import Dict, Tuple

from depthmix.config.schema import ConfigError, ModelConfig

# ours (under decoder.layers.<i>.) -> Hugging Face's (under model.layers.<i>.), one to one
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
QK_NORM_NAMES = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
EMBEDDING, OUTPUT, FINAL_NORM = ("embedding.word_embeddings.weight", "output_layer.weight",
                                 "final_layernorm.weight")
HF_EMBEDDING, HF_OUTPUT, HF_FINAL_NORM = "model.embed_tokens.weight", "lm_head.weight", \
    "model.norm.weight"
ROUTER, EXPERT_BIAS = "mlp.router.weight", "mlp.router.expert_bias"
HF_ROUTER, HF_EXPERT_BIAS = "mlp.gate.weight", "mlp.gate.e_score_correction_bias"
"""The router's weight and expert bias (the bias: the remote-code export only, under
DeepSeek-V3's Hugging Face name)."""
SHARED_EXPERT, HF_SHARED_EXPERT = "mlp.shared_experts.", "mlp.shared_expert."
PACKED_GATE_UP, PACKED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some older checkpoints saved; recomputed, never loaded."""


def layer_names(model: ModelConfig) -> Dict[str, str]:
    """Ours -> theirs for the weights that map one to one, under each layer's prefix."""
    return {**LAYER_NAMES, **(QK_NORM_NAMES if model.qk_layernorm else {})}


def is_moe_layer(model: ModelConfig, layer: int) -> bool:
    return model.experts is not None and model.experts.is_moe_layer(layer)


def swiglu_shapes(prefix: str, d: int, f: int) -> Dict[str, Tuple[int, ...]]:
    return {f"{prefix}gate_proj.weight": (f, d), f"{prefix}up_proj.weight": (f, d),
            f"{prefix}down_proj.weight": (d, f)}


def hf_mlp_shapes(model: ModelConfig, layer: int, packed: bool = False
                  ) -> Dict[str, Tuple[int, ...]]:
    """The MLP tensors of one Hugging Face layer (under ``model.layers.<i>.``): the dense
    SwiGLU, or Qwen3-MoE's router and experts (one by one, or ``packed`` 3-D)."""
    d = model.hidden_size
    if not is_moe_layer(model, layer):
        return swiglu_shapes("mlp.", d, model.ffn_hidden_size)
    e = model.experts
    f, n = e.expert_ffn_hidden_size(model), e.num_experts
    if packed:
        return {HF_ROUTER: (n, d), PACKED_GATE_UP: (n, 2 * f, d), PACKED_DOWN: (n, d, f)}
    out = {HF_ROUTER: (n, d)}
    for j in range(n):
        out.update(swiglu_shapes(f"mlp.experts.{j}.", d, f))
    return out


def hf_shapes(model: ModelConfig, packed: bool = False) -> Dict[str, Tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``model`` holds, with its shape (``packed``:
    experts as 3-D tensors)."""
    d, hd = model.hidden_size, model.kv_channels
    q, kv = model.num_attention_heads * hd, model.num_query_groups * hd
    out = {HF_EMBEDDING: (model.vocab_size, d), HF_FINAL_NORM: (d,)}
    if not model.tie_embeddings:
        out[HF_OUTPUT] = (model.vocab_size, d)
    per_layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q)}
    if model.qk_layernorm:
        per_layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    for i in range(model.num_layers):
        layer = {**per_layer, **hf_mlp_shapes(model, i, packed)}
        out.update({f"model.layers.{i}.{n}": shape for n, shape in layer.items()})
    return out


def is_packed(names) -> bool:
    """Whether a checkpoint's experts are 3-D tensors (``mlp.experts.gate_up_proj``)."""
    return any(n.endswith(PACKED_GATE_UP) for n in names)


def check_names(shapes: Dict[str, Tuple[int, ...]], model: ModelConfig) -> None:
    """Refuse a checkpoint whose tensors (name -> shape) are not exactly ``model``'s (a
    bias, an extra norm, a missing layer, a shape config.json does not give), naming the
    first odd one."""
    names = {n for n in shapes if not n.endswith(IGNORED_SUFFIXES)}
    want = hf_shapes(model, packed=is_packed(names))
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
                f"vocab_size={model.vocab_size}{_moe_shape_fields(model)})")


def _moe_shape_fields(model: ModelConfig) -> str:
    e = model.experts
    return "" if e is None else (f", num_experts={e.num_experts}, moe_intermediate_size="
                                 f"{e.expert_ffn_hidden_size(model)}")
