"""``DepthMixConfig``: Megatron's ``TransformerConfig`` plus what a depth-mixing decoder needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.transformer_config import TransformerConfig

from depthmix.config.megatron import DerivedShape


@dataclass
class DepthMixConfig(TransformerConfig, DerivedShape):
    """One config object passed to every module, in Megatron's idiom.

    The mixer-specific options live in the nested ``mixer`` dataclass (one per method, see
    ``depthmix.megatron_ext.mixers``) rather than as flat fields here.
    """

    mixer: Any = None
    """The method's :class:`~depthmix.megatron_ext.mixers.base.MixerConfig`."""
    vocab_size: int = 50304
    """Padded vocabulary size (a multiple of 128 * tp)."""
    seq_length: int = 2048
    rotary_base: float = 10000.0
    norm_position: str = "pre"
    """``pre`` or ``post`` normalisation of the residual blocks."""
    n_loops: int = 1
    """Looped transformer: ``num_layers`` unique layers applied ``n_loops`` times."""
    init_seed: int = 1234
    """Base seed of the layout-invariant initialisation (see ``model.seeded_init``)."""
