"""The model's shape without Megatron: :class:`Shape`, the one object the FLOP, parameter
and memory formulas, the mixers' plans and cost hooks and the transport geometry read when
no model is built (the dry run, the planner, the accounting). Its fields have the names and
values of ``DepthMixConfig``'s, so a hook reads either; :class:`DerivedShape` holds what
both derive from those fields. The head width and the padded vocabulary are the model
config's (``ModelConfig.kv_channels``, ``ModelConfig.padded_vocab_size``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from depthmix.config.schema import RunConfig


class DerivedShape:
    """Properties derived from the shape fields, shared by :class:`Shape` and
    ``DepthMixConfig``."""

    @property
    def unrolled_layers(self) -> int:
        """Depth of the computation: unique layers times loops."""
        return self.num_layers * self.n_loops


@dataclass
class Shape(DerivedShape):
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    seq_length: int
    vocab_size: int
    """Padded."""
    n_loops: int
    qk_layernorm: bool
    sequence_parallel: bool
    tensor_model_parallel_size: int
    tie_embeddings: bool = False
    """The output layer reads the embedding's matrix (one copy at PP=1)."""
    mixer: Any = None
    """The run's :class:`~depthmix.mixers.base.MixerConfig`."""

    @classmethod
    def of(cls, run: RunConfig) -> "Shape":
        m, p = run.model, run.parallel
        return cls(
            num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
            kv_channels=m.kv_channels, seq_length=m.seq_length, vocab_size=m.padded_vocab_size,
            n_loops=m.n_loops, qk_layernorm=m.qk_layernorm, sequence_parallel=p.sequence_parallel,
            tensor_model_parallel_size=p.tp, tie_embeddings=m.tie_embeddings, mixer=run.mixer,
        )

    @property
    def short_swa_window(self) -> int:
        """``mixer.short_swa_window`` (0: no ShortSWA sublayer)."""
        return self.mixer.short_swa_window if self.mixer is not None else 0
