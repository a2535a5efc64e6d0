"""The one function that maps a :class:`RunConfig` onto Megatron's ``TransformerConfig``
(:func:`to_transformer_config`), and its Megatron-free stand-in for plans and cost hooks
(:func:`plan_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from depthmix.config.schema import RunConfig
from depthmix.config.validate import padded_vocab_size  # noqa: F401  (re-exported)


class DerivedShape:
    """Properties derived from a config's shape fields, shared by :class:`PlanConfig` and
    ``DepthMixConfig`` (both hold ``num_layers``, ``n_loops``, ``kv_channels`` and heads)."""

    @property
    def unrolled_layers(self) -> int:
        """Depth of the computation: unique layers times loops."""
        return self.num_layers * self.n_loops

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_query_groups


@dataclass
class PlanConfig(DerivedShape):
    """The fields of ``DepthMixConfig`` that mixers' plans and cost hooks and the accounting
    read, built without Megatron (the dry run). Same names and values as the real config."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    seq_length: int
    vocab_size: int
    n_loops: int
    qk_layernorm: bool
    sequence_parallel: bool
    tensor_model_parallel_size: int
    mixer: Any = None


def plan_config(run: RunConfig) -> PlanConfig:
    m, p = run.model, run.parallel
    return PlanConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim or m.hidden_size // m.num_attention_heads,
        seq_length=m.seq_length,
        vocab_size=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by),
        n_loops=m.n_loops, qk_layernorm=m.qk_layernorm, sequence_parallel=p.sequence_parallel,
        tensor_model_parallel_size=p.tp, mixer=run.mixer,
    )


def to_transformer_config(run: RunConfig):
    """Build the :class:`DepthMixConfig` every module receives.

    Choices the papers leave open, made here: Qwen3-style layers (RMSNorm, SwiGLU, QK-norm,
    RoPE, no biases, no dropout); every weight initialised N(0, init_std) as in the papers'
    Hugging Face configs ("initializer range"), so output projections are *not* scaled by
    1/sqrt(2L) as Megatron's default would; untied embeddings.
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.utils import init_method_normal

    from depthmix.megatron_ext.config import DepthMixConfig

    m, p, t = run.model, run.parallel, run.train
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
    init = init_method_normal(m.init_std)
    return DepthMixConfig(
        # architecture
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim or m.hidden_size // m.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        init_method=init,
        output_layer_init_method=init,
        # parallelism
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vp,
        sequence_parallel=p.sequence_parallel,
        use_cpu_initialization=p.use_cpu_initialization,
        deallocate_pipeline_outputs=True,
        # Interleaved with 2 stages: the previous and next stage are the same rank, and a
        # batched send of an activation and a gradient to it can be matched in the wrong
        # order. Megatron's unbatched path puts the two directions on different groups.
        batch_p2p_comm=not (p.vp is not None and p.pp == 2),
        recompute_granularity="full" if p.recompute == "full" else None,
        recompute_method="uniform" if p.recompute == "full" else None,
        recompute_num_layers=1 if p.recompute == "full" else None,
        # precision
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        # fusions that need Apex/TE are off; SDPA and our kernels do the heavy lifting
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        # depthmix
        mixer=run.mixer,
        vocab_size=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by),
        seq_length=m.seq_length,
        rotary_base=m.rotary_base,
        norm_position=m.norm_position,
        n_loops=m.n_loops,
        init_seed=t.seed,
    )
