"""What every mixer provides (re-exported from :mod:`depthmix.config.mixers.base`) and the
helper its Megatron modules share."""

from __future__ import annotations

from depthmix.config.mixers.base import (  # noqa: F401  (re-exported)
    IMPLS,
    NO_EXTRA_PARAMS,
    ExtraParams,
    Mixer,
    MixerConfig,
    model_spec_in,
    residual_plan,
    residual_stream_entry,
)


def mark_mixing_parameter(param, config) -> None:
    """Per-token parameters on the full hidden: grads are partial per sequence shard under
    sequence parallelism (all-reduced over TP), and they are excluded from weight decay."""
    param.sequence_parallel = config.sequence_parallel
    param.no_weight_decay = True
