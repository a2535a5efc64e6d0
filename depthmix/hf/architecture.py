"""Hugging Face ``config.json`` <-> :class:`~depthmix.config.schema.ModelConfig` (no torch).

Our decoder is Qwen3-shaped: RMSNorm, SwiGLU, RoPE, GQA, no biases, pre-norm, and
per-head RMSNorm of queries and keys (``model.qk_layernorm``). So it holds

* ``qwen3`` (``Qwen3ForCausalLM``) as is, and
* ``llama`` (``LlamaForCausalLM``: Llama 2/3, and models saved as Llama) with
  ``model.qk_layernorm=false``,

with or without tied input/output embeddings (``model.tie_embeddings``). Anything else
changes the computation and is refused, naming the field: biases, RoPE scaling or partial
rotary, sliding-window attention, mixture-of-experts, another activation, attention dropout,
another ``model_type`` (Qwen2's q/k/v projections always carry biases). ``config.json`` is
read both as ``transformers`` 5 writes it (``rope_parameters``) and as 4.x did
(``rope_theta``, ``rope_scaling``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional

from depthmix.config.schema import ConfigError, ModelConfig
from depthmix.config.validate import TORCH_DTYPES

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
"""``model_type`` -> the ``transformers`` class we import and export."""
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
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
    for field in MOE_FIELDS:
        if cfg.get(field):
            raise _refuse(field, cfg[field], "mixture-of-experts layers do not map onto our "
                          "dense SwiGLU MLP")
    kind = cfg.get("model_type")
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
    if kind != "qwen3" and cfg.get("sliding_window"):  # Qwen3 keeps it beside the switch
        raise _refuse("sliding_window", cfg["sliding_window"],
                      "sliding-window attention does not map")
    other = sorted(set(cfg.get("layer_types") or ()) - {"full_attention"})
    if other:
        raise _refuse("layer_types", other, "only full attention maps")
    if cfg.get("attention_dropout"):
        raise _refuse("attention_dropout", cfg["attention_dropout"], "our attention has no "
                      "dropout")
    _rope(cfg)
    return kind


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
        qk_layernorm=kind == "qwen3",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if model.num_attention_heads % model.num_query_groups:
        raise _refuse("num_key_value_heads", model.num_query_groups,
                      f"must divide num_attention_heads={heads}")
    return model


def hf_config(model: ModelConfig) -> Dict[str, Any]:
    """The architecture part of ``config.json`` for our model: ``qwen3`` with QK-norm,
    ``llama`` without (the inverse of :func:`model_config`)."""
    kind = "qwen3" if model.qk_layernorm else "llama"
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
    if kind == "qwen3":
        config.update(use_sliding_window=False, sliding_window=None)
    else:
        config.update(mlp_bias=False)
    return config
