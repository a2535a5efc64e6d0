"""Hugging Face models built here from random weights (no hub): a Qwen3 (head_dim != hidden /
heads, RoPE base 5e4), a Llama (no QK-norm, RoPE base 5e5), a Qwen3 with tied embeddings and
two Qwen3-MoE (experts on every second layer with renormalised top-2 weights, untied; experts
on all layers but the first with softmax-probability weights, tied), all tiny, fp32, with a
byte-level BPE tokenizer; a small token dataset; transformers' loss over our evaluation
windows."""

import os

import numpy as np
import torch

VOCAB = 320  # a multiple of 64: the import pads nothing, and TP2 divides it
SEQ = 16  # --seq-length of the imports: the eval windows
TEXTS = ["the quick brown fox jumps over the lazy dog", "depth mixing reads earlier layers",
         "attention over depth and over the sequence", "a tiny model for a tiny test"] * 8
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             initializer_range=0.2, rms_norm_eps=1e-6)
"""``initializer_range`` 0.2 (and random norm gains): logits spread over several units, so
greedy decoding has no near-ties to break differently."""
DENSE_KINDS = ("qwen3", "llama", "qwen3_tied")
MOE_KINDS = ("qwen3_moe", "qwen3_moe_tied")
KINDS = DENSE_KINDS + MOE_KINDS
MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         decoder_sparse_step=2, norm_topk_prob=True),
       "qwen3_moe_tied": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                              mlp_only_layers=[0], norm_topk_prob=False)}
"""The routers keep transformers' init (std ``initializer_range``): router logits spread
over about a unit, so no token's k-th and (k+1)-th experts tie within rounding."""


def hf_model(kind: str):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(KINDS.index(kind))
    if kind in MOE:
        tied = kind == "qwen3_moe_tied"
        config = Qwen3MoeConfig(head_dim=16 if tied else 24, tie_word_embeddings=tied,
                                rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                                router_aux_loss_coef=0.01, **MOE[kind], **SHAPE)
        model = Qwen3MoeForCausalLM(config)
    elif kind == "llama":
        config = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                             **SHAPE)
        model = LlamaForCausalLM(config)
    else:
        tied = kind == "qwen3_tied"
        config = Qwen3Config(head_dim=16 if tied else 24, tie_word_embeddings=tied,
                             rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                             **SHAPE)
        model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.eval()


def save_hf(model, path: str, tokenizer_file: str) -> str:
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, eos_token="<|endoftext|>",
                            pad_token="<|padding|>").save_pretrained(path)
    return path


def write_tokens(prefix: str, n: int, seed: int) -> None:
    """A Megatron ``.bin/.idx`` of ``n`` random tokens below ``VOCAB``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    g = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    while n:
        k = min(n, int(g.integers(1, 41)))
        builder.add_document(torch.from_numpy(g.integers(0, VOCAB, k)), [k])
        n -= k
    builder.finalize(f"{prefix}.idx")


def hf_window_loss(model, prefix: str, seq_length: int = SEQ) -> tuple:
    """Transformers' mean NLL over the windows of ``depthmix.evaluate.windows`` (inputs
    ``stream[i*S:(i+1)*S]``, targets shifted by one; the last window partial), cut here from
    the raw ``.bin``."""
    stream = torch.from_numpy(np.fromfile(f"{prefix}.bin", dtype=np.uint16).astype(np.int64))
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, seq_length):
            piece = stream[start:start + seq_length + 1]
            logits = model(piece[None, :-1]).logits[0].double()
            total += float(-torch.log_softmax(logits, -1).gather(-1, piece[1:, None]).sum())
            tokens += len(piece) - 1
    return total / tokens, tokens


def checkpoints(out: str) -> str:
    return os.path.join(out, "checkpoints")
