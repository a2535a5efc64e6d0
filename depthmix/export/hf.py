"""A checkpoint -> a Hugging Face ``transformers`` model directory (``depthmix-export``:
:mod:`depthmix.cli.export`).

* ``mixer=vanilla`` -> ``Qwen3ForCausalLM`` (``model_type: qwen3``; ``LlamaForCausalLM``
  with ``model.qk_layernorm=false``; ``Qwen3MoeForCausalLM`` with experts whose router
  Qwen3-MoE computes: softmax top-k, no expert bias, scale or shared expert), loaded by
  ``AutoModelForCausalLM.from_pretrained(out)`` with no custom code; tied embeddings
  (``model.tie_embeddings``) stay tied;
* ``mixer=depth_attn``, and ``mixer=vanilla`` with a router Qwen3-MoE lacks (sigmoid
  scores, DeepSeek-V3's expert bias, a routed scale, a shared expert) -> the same weights,
  ``model_type: depthmix_qwen3`` and ``modeling_depthmix_qwen3.py`` beside them, loaded with
  ``trust_remote_code=True`` (``auto_map`` in ``config.json``);
* any other mixer is refused, naming it, until its modeling code exists.

The checkpoint may have been saved at any TP/PP/VP layout (``load_model`` reshards). Weights
map from Megatron's names as :mod:`depthmix.hf.weights` says (fused ``linear_qkv`` and SwiGLU
``linear_fc1`` split, experts one by one; the embedding and output layer keep the real
vocabulary, ``model.vocab_size`` rows, so the exported logits are ours with the padded
columns dropped). Experts export dropless, as ``load_model`` runs them. The directory also
holds the tokenizer (``tokenizer.json`` plus ``tokenizer_config.json`` naming its special
tokens) when the checkpoint carries one or ``--tokenizer`` names one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Dict, Optional

import torch

from depthmix.config.schema import ConfigError
from depthmix.config.validate import PRECISIONS
from depthmix.hf import architecture
from depthmix.hf.names import EXPERT_BIAS, HF_EXPERT_BIAS
from depthmix.hf.weights import to_hf
from depthmix.runtime import precision

log = logging.getLogger("depthmix")

SUPPORTED = ("vanilla", "depth_attn")
REMOTE_CODE = "modeling_depthmix_qwen3.py"


def check_exportable(run) -> None:
    """Raise :class:`ConfigError` naming the option when no ``transformers`` model matches."""
    m, mixer = run.model, run.mixer
    if mixer.name not in SUPPORTED:
        raise ConfigError(f"mixer={mixer.name}: no Hugging Face modeling code for this mixer "
                          f"yet; depthmix-export supports {list(SUPPORTED)}")
    if mixer.short_swa_window:
        raise ConfigError(f"mixer.short_swa_window={mixer.short_swa_window}: ShortSWA has no "
                          "Hugging Face modeling code yet; export supports it off (0)")
    if m.norm_position != "pre":
        raise ConfigError(f"model.norm_position={m.norm_position}: Qwen3 is pre-norm")
    if not m.qk_layernorm and mixer.name != "vanilla":
        raise ConfigError(f"model.qk_layernorm=false: exported as Llama, which has no "
                          f"modeling code for mixer={mixer.name}")
    if m.n_loops != 1:
        raise ConfigError(f"model.n_loops={m.n_loops}: looped models have no Hugging Face "
                          "modeling code yet")
    if m.experts is not None and not m.qk_layernorm:
        raise ConfigError("model.qk_layernorm=false with experts: exported as Llama, which "
                          "has no experts")
    if mixer.name == "depth_attn" and mixer.mixed_state != "value":
        raise ConfigError(f"mixer.mixed_state={mixer.mixed_state}: the exported modeling code "
                          "implements mixed_state=value only")


def needs_remote_code(run) -> bool:
    """Whether the export is ``depthmix_qwen3`` (Depth-Attention, or a router Qwen3-MoE
    lacks) rather than a ``transformers`` class."""
    experts = run.model.experts
    return run.mixer.name == "depth_attn" or (
        experts is not None and architecture.qwen3_moe_mismatch(experts) is not None)


def hf_config(run, dtype: torch.dtype, special: Dict[str, Optional[int]]) -> dict:
    """``config.json`` for the exported model."""
    config = {
        **architecture.hf_config(run.model),
        "dtype": str(dtype).replace("torch.", ""),
        **special,
    }
    if needs_remote_code(run):
        name = REMOTE_CODE[:-3]
        config.update(
            architectures=["DepthMixQwen3ForCausalLM"], model_type="depthmix_qwen3",
            auto_map={"AutoConfig": f"{name}.DepthMixQwen3Config",
                      "AutoModelForCausalLM": f"{name}.DepthMixQwen3ForCausalLM"},
            depth_attn=run.mixer.name == "depth_attn")
        if run.mixer.name == "depth_attn":
            config.update(depth_attn_stride=run.mixer.stride,
                          depth_attn_source_mode=run.mixer.source_mode,
                          depth_attn_mix_rule=run.mixer.mix_rule)
        if run.model.experts is not None:
            e = run.model.experts
            config.update(moe_score_function=e.score_function, moe_expert_bias=e.expert_bias,
                          moe_routed_scaling_factor=e.routed_scaling_factor,
                          moe_shared_expert_intermediate_size=e.shared_expert_ffn_hidden_size)
    return config


def hf_state_dict(model, run) -> Dict[str, torch.Tensor]:
    """Our single-rank model's weights under Hugging Face's names (every parameter used
    once; :func:`depthmix.hf.weights.to_hf`)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    params.update({k: v.detach() for k, v in model.named_buffers()
                   if k.endswith(EXPERT_BIAS)})  # the routing's, not a weight
    try:
        return to_hf(params, run.model)
    except ConfigError as e:  # e.g. a mixer's own parameters: exporting would drop them
        raise ConfigError(f"mixer={run.mixer.name}: {e}") from None


def _save_tokenizer(path: str, out_dir: str, seq_length: int) -> Dict[str, Optional[int]]:
    """Write the tokenizer files ``AutoTokenizer`` reads; returns the special-token ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from depthmix.data.tokenizer import HFTokenizer

    ours, tok = HFTokenizer(path), Tokenizer.from_file(path)
    bos = eos = tok.id_to_token(ours.eod)
    pad = tok.id_to_token(ours.pad)
    hf = PreTrainedTokenizerFast(tokenizer_file=path, bos_token=bos, eos_token=eos,
                                 pad_token=pad, model_max_length=seq_length)
    hf.save_pretrained(out_dir)
    return {"bos_token_id": ours.eod, "eos_token_id": ours.eod, "pad_token_id": ours.pad}


def export(checkpoint: str, out_dir: str, dtype: Optional[str] = None,
           tokenizer: Optional[str] = None) -> str:
    """Export ``checkpoint`` (a save dir or one ``iter_*``) to ``out_dir``; returns ``out_dir``.

    ``dtype``: ``fp32``, ``bf16`` or ``fp16`` (default: the training precision).
    ``tokenizer``: a ``tokenizers`` JSON file (default: the one saved with the checkpoint).
    """
    from safetensors.torch import save_file

    from depthmix.checkpoint.record import run_from_record
    from depthmix.checkpoint.store import find_checkpoint, read_meta
    from depthmix.inference.load import load_model

    if dtype is not None and dtype not in PRECISIONS:
        raise ConfigError(f"--dtype={dtype} must be one of {list(PRECISIONS)}")
    found = find_checkpoint(checkpoint, option="checkpoint")
    run = run_from_record(read_meta(found)["record"], impl="torch")
    check_exportable(run)  # before loading any weights
    if tokenizer is not None and not os.path.isfile(tokenizer):
        raise ConfigError(f"--tokenizer={tokenizer}: no such file")
    torch_dtype = precision.torch_dtype(dtype or run.train.precision)
    loaded = load_model(found, impl="torch", device=torch.device("cpu"))
    tokenizer = tokenizer or loaded.tokenizer_path

    os.makedirs(out_dir, exist_ok=True)
    special = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if tokenizer is not None:
        special = _save_tokenizer(tokenizer, out_dir, run.model.seq_length)
    else:
        log.warning("depthmix-export: %s carries no tokenizer and --tokenizer is not given; "
                    "exporting the model without tokenizer files", found)
    # the expert bias stays fp32, as the router keeps and adds it (top-k choices in any dtype)
    weights = {k: v.to(torch.float32 if k.endswith(HF_EXPERT_BIAS) else torch_dtype)
               .contiguous() for k, v in hf_state_dict(loaded.model, run).items()}
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(run, torch_dtype, special), f, indent=2)
    if needs_remote_code(run):
        shutil.copyfile(os.path.join(os.path.dirname(__file__), REMOTE_CODE),
                        os.path.join(out_dir, REMOTE_CODE))
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in special.items() if v is not None}, f, indent=2)
    return out_dir
