"""The model's shape without Megatron: what mixers' plans and cost hooks and the accounting
read (:class:`PlanConfig`, built by :func:`plan_config`), and the properties derived from it
(:class:`DerivedShape`, shared with ``DepthMixConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from depthmix.config.schema import RunConfig
from depthmix.config.validate import padded_vocab_size


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
