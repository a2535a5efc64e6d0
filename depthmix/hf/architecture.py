"""Hugging Face ``config.json`` <-> :class:`~depthmix.config.schema.ModelConfig` (no torch).

Our decoder is Qwen3-shaped: RMSNorm, SwiGLU, RoPE, GQA, no biases, pre-norm, and
per-head RMSNorm of queries and keys (``model.qk_layernorm``). So it holds

* ``qwen3`` (``Qwen3ForCausalLM``) as is,
* ``qwen3_moe`` (``Qwen3MoeForCausalLM``) with ``model.moe``: its sparse MLP is Megatron's
  MoE layer with a softmax top-k router and no shared expert (:func:`moe_config`), and
* ``llama`` (``LlamaForCausalLM``: Llama 2/3, and models saved as Llama) with
  ``model.qk_layernorm=false``,

with or without tied input/output embeddings (``model.tie_embeddings``). Anything else
changes the computation and is refused, naming the field: biases, RoPE scaling or partial
rotary, sliding-window attention, experts outside ``qwen3_moe`` (or a shared expert, or
experts on layers ``model.moe`` cannot place), another activation, attention dropout,
another ``model_type`` (Qwen2's q/k/v projections always carry biases). ``config.json`` is
read both as ``transformers`` 5 writes it (``rope_parameters``, ``num_local_experts``) and
as 4.x did (``rope_theta``, ``rope_scaling``, ``num_experts``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from depthmix.config.schema import ConfigError, ModelConfig, MoEConfig
from depthmix.config.validate import TORCH_DTYPES

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "llama": "LlamaForCausalLM"}
"""``model_type`` -> the ``transformers`` class we import and export."""
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts",
                        "moe_shared_expert_intermediate_size")
PRECISION_OF = {name: precision for precision, name in TORCH_DTYPES.items()}
"""``config.json``'s ``dtype`` -> our ``train.precision``."""


def _refuse(field: str, value: Any, why: str) -> ConfigError:
    shown = str(value).lower() if isinstance(value, bool) else value
    return ConfigError(f"{field}={shown} in config.json: {why}")


def _rope(cfg: Dict[str, Any]) -> float:
    """RoPE base; refuses scaled or partial rotary embeddings."""
    if cfg.get("rope_scaling"):
        raise _refuse("rope_scaling", cfg["rope_scaling"], "RoPE scaling does not map (our "
                      "RoPE is the plain one, base model.rotary_base)")
    params = cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise _refuse("rope_parameters.rope_type", kind, "RoPE scaling does not map (our RoPE "
                      "is the plain one, base model.rotary_base)")
    for source in (params, cfg):
        partial = source.get("partial_rotary_factor")
        if partial not in (None, 1, 1.0):
            raise _refuse("partial_rotary_factor", partial, "we rotate whole heads")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def check_maps(cfg: Dict[str, Any]) -> str:
    """The ``model_type`` of ``cfg`` when it maps onto our decoder, else a
    :class:`ConfigError` naming the first field that does not."""
    kind = cfg.get("model_type")
    for field in MOE_FIELDS if kind != "qwen3_moe" else SHARED_EXPERT_FIELDS:
        if cfg.get(field):
            why = ("Qwen3-MoE has no shared expert" if kind == "qwen3_moe" else
                   f"experts map from model_type=qwen3_moe only, not model_type={kind}")
            raise _refuse(field, cfg[field], why)
    if kind not in ARCHITECTURES:
        why = ("its q/k/v projections carry biases, which do not map" if kind == "qwen2"
               else f"depthmix-import maps {sorted(ARCHITECTURES)}")
        raise _refuse("model_type", kind, why)
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise _refuse(field, cfg[field], "biases do not map onto our bias-free layers")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg["hidden_act"], "our MLP is SwiGLU (silu)")
    if cfg.get("use_sliding_window"):
        raise _refuse("use_sliding_window", True, "sliding-window attention does not map")
    if kind == "llama" and cfg.get("sliding_window"):  # Qwen3 keeps it beside the switch
        raise _refuse("sliding_window", cfg["sliding_window"],
                      "sliding-window attention does not map")
    other = sorted(set(cfg.get("layer_types") or ()) - {"full_attention"})
    if other:
        raise _refuse("layer_types", other, "only full attention maps")
    if cfg.get("attention_dropout"):
        raise _refuse("attention_dropout", cfg["attention_dropout"], "our attention has no "
                      "dropout")
    _rope(cfg)
    if kind == "qwen3_moe":
        moe_config(cfg)
    return kind


def _num_experts(cfg: Dict[str, Any]) -> int:
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map)
    return int(cfg.get("num_experts", cfg.get("num_local_experts")) or 0)


def hf_moe_layers(cfg: Dict[str, Any]) -> List[int]:
    """The layers with experts in a ``qwen3_moe`` config (``Qwen3MoeDecoderLayer``'s rule)."""
    step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    return [i for i in range(cfg["num_hidden_layers"])
            if i not in dense and _num_experts(cfg) > 0 and (i + 1) % step == 0]


def moe_config(cfg: Dict[str, Any]) -> MoEConfig:
    """``model.moe`` for a ``qwen3_moe`` config: a softmax router over ``num_experts``, the
    top ``num_experts_per_tok`` (renormalised with ``norm_topk_prob``), experts of width
    ``moe_intermediate_size`` on the layers of ``decoder_sparse_step`` / ``mlp_only_layers``,
    which must be ours: the first k layers dense, then every n-th."""
    experts, top_k = _num_experts(cfg), cfg.get("num_experts_per_tok", 8)
    layers = hf_moe_layers(cfg)
    if not layers:
        raise _refuse("num_experts", experts, "no layer has experts (decoder_sparse_step, "
                      "mlp_only_layers): a dense Qwen3 imports as model_type=qwen3")
    if not 1 <= top_k <= experts:
        raise _refuse("num_experts_per_tok", top_k, f"must be in [1, num_experts={experts}]")
    normalize = bool(cfg.get("norm_topk_prob", False))
    if normalize and top_k == 1:
        raise _refuse("norm_topk_prob", True, "with num_experts_per_tok=1 every weight is 1; "
                      "model.moe routes one expert by its softmax probability")
    first = layers[0]
    freq = layers[1] - first if len(layers) > 1 else cfg["num_hidden_layers"] - first
    moe = MoEConfig(num_experts=experts, top_k=top_k,
                    ffn_hidden_size=cfg.get("moe_intermediate_size"),
                    first_dense_layers=first, layer_freq=freq, score_function="softmax",
                    normalize_top_k=normalize,
                    aux_loss_coeff=float(cfg.get("router_aux_loss_coef") or 0.0))
    if [i for i in range(cfg["num_hidden_layers"]) if moe.is_moe_layer(i)] != layers:
        field = "mlp_only_layers" if cfg.get("mlp_only_layers") else "decoder_sparse_step"
        raise _refuse(field, cfg.get(field), f"experts on layers {layers}, which model.moe "
                      "cannot place (the first k layers dense, then every n-th layer)")
    return moe


def qwen3_moe_mismatch(moe: MoEConfig) -> Optional[str]:
    """The first ``model.moe`` option ``Qwen3MoeForCausalLM`` does not compute (its router is
    a softmax top-k without bias, scale or shared expert), or None."""
    for option, plain in (("score_function", "softmax"), ("expert_bias", False),
                          ("shared_expert_ffn_hidden_size", 0),
                          ("routed_scaling_factor", None)):
        value = getattr(moe, option)
        if value != plain and not (option == "routed_scaling_factor" and value == 1):
            shown = str(value).lower() if isinstance(value, bool) else value
            return f"model.moe.{option}={shown}"
    return None


def preset_name(path: str) -> str:
    """A Hydra-friendly preset name from a folder name: ``Qwen3-0.6B`` -> ``qwen3_0p6b``."""
    base = re.sub(r"(\d)\.(\d)", r"\1p\2", path.rstrip("/").split("/")[-1].lower())
    return re.sub(r"[^a-z0-9]+", "_", base).strip("_") or "imported"


def vocab_multiple(vocab_size: int) -> int:
    """The largest power of two up to 128 dividing the vocabulary: the embedding then has
    exactly the Hugging Face rows (no padded logits to change the loss), and tensor
    parallelism is possible up to that size."""
    multiple = 128
    while vocab_size % multiple:
        multiple //= 2
    return multiple


def model_config(cfg: Dict[str, Any], name: str, seq_length: Optional[int] = None
                 ) -> ModelConfig:
    """Our model preset for the Hugging Face ``cfg`` (checked with :func:`check_maps`)."""
    kind = check_maps(cfg)
    heads = cfg["num_attention_heads"]
    model = ModelConfig(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim"),
        vocab_size=cfg["vocab_size"],
        make_vocab_size_divisible_by=vocab_multiple(cfg["vocab_size"]),
        seq_length=seq_length or cfg.get("max_position_embeddings", 2048),
        init_std=cfg.get("initializer_range", 0.02),
        norm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        rotary_base=_rope(cfg),
        qk_layernorm=kind != "llama",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        moe=moe_config(cfg) if kind == "qwen3_moe" else MoEConfig(),
    )
    if model.num_attention_heads % model.num_query_groups:
        raise _refuse("num_key_value_heads", model.num_query_groups,
                      f"must divide num_attention_heads={heads}")
    return model


def hf_config(model: ModelConfig) -> Dict[str, Any]:
    """The architecture part of ``config.json`` for our model: ``qwen3`` with QK-norm,
    ``qwen3_moe`` with experts too, ``llama`` without QK-norm (the inverse of
    :func:`model_config`)."""
    kind = "llama" if not model.qk_layernorm else "qwen3_moe" if model.experts else "qwen3"
    config = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": model.seq_length,
        "rms_norm_eps": model.norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(model.rotary_base)},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_embeddings,
        "initializer_range": model.init_std,
        "use_cache": True,
    }
    if kind == "llama":
        config.update(mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    if model.experts:
        config.update(_hf_moe_fields(model))
    return config


def _hf_moe_fields(model: ModelConfig) -> Dict[str, Any]:
    """Qwen3-MoE's expert fields (the inverse of :func:`moe_config`): the MoE layers as
    ``decoder_sparse_step`` alone where it can say them, else every layer but
    ``mlp_only_layers``."""
    e = model.experts
    layers = range(model.num_layers)
    if e.first_dense_layers == e.layer_freq - 1:
        step, dense = e.layer_freq, []
    else:
        step, dense = 1, [i for i in layers if not e.is_moe_layer(i)]
    return {"num_experts": e.num_experts, "num_experts_per_tok": e.top_k,
            "moe_intermediate_size": e.expert_ffn_hidden_size(model),
            "norm_topk_prob": e.normalize_top_k, "decoder_sparse_step": step,
            "mlp_only_layers": dense,
            "router_aux_loss_coef": e.aux_loss_coeff if e.aux_loss_scope == "batch" else 0.0,
            "output_router_logits": False}
