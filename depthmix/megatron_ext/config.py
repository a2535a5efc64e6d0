"""``DepthMixConfig``: Megatron's ``TransformerConfig`` plus what a depth-mixing decoder needs, and
the one function that maps a :class:`RunConfig` onto it (:func:`to_transformer_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.transformer_config import TransformerConfig

from depthmix.config.schema import RunConfig
from depthmix.config.validate import expert_tp_size
from depthmix.planning.shape import DerivedShape


@dataclass
class DepthMixConfig(TransformerConfig, DerivedShape):
    """One config object passed to every module, in Megatron's idiom.

    The mixer-specific options live in the nested ``mixer`` dataclass (one per method, see
    ``depthmix.mixers``) rather than as flat fields here.
    """

    mixer: Any = None
    """The method's :class:`~depthmix.mixers.base.MixerConfig`."""
    vocab_size: int = 50304
    """Padded vocabulary size (a multiple of 128 * tp)."""
    seq_length: int = 2048
    rotary_base: float = 10000.0
    norm_position: str = "pre"
    """``pre`` or ``post`` normalisation of the residual blocks."""
    n_loops: int = 1
    """Looped transformer: ``num_layers`` unique layers applied ``n_loops`` times."""
    tie_embeddings: bool = False
    """The output layer reads the input embedding's matrix (Megatron's shared embedding and
    output weights)."""
    init_seed: int = 1234
    """Base seed of the layout-invariant initialisation (see ``model.seeded_init``)."""
    fused_cross_entropy: bool = False
    """The loss without the full logits (``train.fused_cross_entropy``,
    :mod:`depthmix.megatron_ext.loss`)."""
    moe_experts_impl: str = "sequential"
    """The routed experts' module (``model.moe.experts_impl``, resolved): ``sequential``
    (Megatron's ``SequentialMLP``) or ``grouped`` (:mod:`depthmix.megatron_ext.grouped_experts`)."""


def to_transformer_config(run: RunConfig):
    """Build the :class:`DepthMixConfig` every module receives.

    Choices the papers leave open, made here: Qwen3-style layers (RMSNorm, SwiGLU, QK-norm,
    RoPE, no biases, no dropout); every weight initialised N(0, init_std) as in the papers'
    Hugging Face configs ("initializer range"), so output projections are *not* scaled by
    1/sqrt(2L) as Megatron's default would; embeddings untied unless ``model.tie_embeddings``.
    """
    import torch.nn.functional as F
    from megatron.core.utils import init_method_normal

    from depthmix.megatron_ext.loss import enabled as fused_loss_enabled
    from depthmix.runtime.precision import torch_dtype

    m, p, t = run.model, run.parallel, run.train
    dtype = torch_dtype(t.precision)
    init = init_method_normal(m.init_std)
    return DepthMixConfig(
        # architecture
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
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
        vocab_size=m.padded_vocab_size,
        seq_length=m.seq_length,
        rotary_base=m.rotary_base,
        norm_position=m.norm_position,
        n_loops=m.n_loops,
        tie_embeddings=m.tie_embeddings,
        init_seed=t.seed,
        fused_cross_entropy=fused_loss_enabled(run),
        **_moe_fields(run),
    )


def _moe_fields(run: RunConfig) -> dict:
    """``model.moe`` as Megatron's ``moe_*`` fields (none for a dense model): its own
    ``MoELayer`` with the all-to-all dispatcher (no Transformer Engine, none of Megatron's
    grouped GEMMs: ``moe_experts_impl`` picks sequential or torch-native grouped experts),
    routing in fp32."""
    from depthmix.config.load import resolve_experts_impl

    m, e = run.model, run.model.experts
    if e is None:
        return {}
    resolve_experts_impl(run)  # a run built in code, not composed, may still say auto
    balancing = {"batch": "aux_loss", "sequence": "seq_aux_loss"}[e.aux_loss_scope]
    return dict(
        num_moe_experts=e.num_experts,
        moe_ffn_hidden_size=e.expert_ffn_hidden_size(m),
        moe_shared_expert_intermediate_size=e.shared_expert_ffn_hidden_size or None,
        moe_layer_freq=[int(e.is_moe_layer(i)) for i in range(m.num_layers)],
        moe_router_topk=e.top_k,
        moe_router_score_function=e.score_function,
        # softmax: over all experts before the top-k (unnormalised weights) or over the k
        # chosen (normalised); sigmoid weights are always normalised when k > 1
        moe_router_pre_softmax=not e.normalize_top_k,
        moe_router_topk_scaling_factor=e.routed_scaling_factor,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type=balancing if e.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=e.aux_loss_coeff,
        moe_router_enable_expert_bias=e.expert_bias,
        moe_router_bias_update_rate=e.expert_bias_update_rate,
        moe_z_loss_coeff=e.z_loss_coeff or None,
        moe_expert_capacity_factor=None if e.dropless else e.capacity_factor,
        moe_token_drop_policy="probs",
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=run.parallel.ep,
        moe_experts_impl=e.experts_impl,
        expert_tensor_parallel_size=expert_tp_size(run.parallel),
    )
