"""``mixer=ddl`` without its model code: options, plan and cost.

The method (Deep Delta Learning residual updates) and its Megatron modules are described
in :mod:`depthmix.mixers.ddl.model`; its read and update ops in :mod:`depthmix.kernels.ddl`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from depthmix.mixers.base import ExtraParams, Mixer, MixerConfig, SavedActivations, Variant
from depthmix.mixers.base import LOOPED, OpCall, model_hook
from depthmix.config.schema import ConfigError
from depthmix.planning.depth_plan import STEM, Entry

STATE = "ddl"
"""Depth-state name of the DDL matrix state ``[s, b, h, d_v]``."""


@dataclass
class DDLConfig(MixerConfig):
    """``mixer=ddl``: Deep Delta Learning residual updates."""

    name: str = "ddl"
    value_channels: int = 4
    """``d_v``: columns of the per-token state ``X in R^{d x d_v}`` (1 = the scalar-value
    form; the paper's expanded state uses 4)."""
    beta_init: float = 1.0
    """Gate at initialisation: the bias of ``beta = 2 sigmoid(.)`` is ``logit(beta_init/2)``
    (reference default 1.0: the projection regime)."""
    v_scale: float = 4.0
    """``v = v_scale * sigmoid(W_v x_in + b_v)`` (reference default 4)."""

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        self.check_at_least("value_channels", 1)
        if not 0.0 < self.beta_init < 2.0:
            raise ConfigError(f"mixer.beta_init={self.beta_init} must be in (0, 2) "
                              "(beta = 2 sigmoid(.) never reaches 0 or 2)")
        if not self.v_scale > 0.0:
            raise ConfigError(f"mixer.v_scale={self.v_scale} must be > 0")
        self.check_pre_norm(model)


def ddl_plan(config, tp: int) -> List[Entry]:
    """One entry: the ``h x d_v`` state per token on the sequence-parallel shard."""
    n = config.unrolled_layers
    return [Entry(STATE, writers=(STEM, *range(n)), readers=(*range(n), n),
                  shape=(config.hidden_size, config.mixer.value_channels), seq_sharded=True)]


def extra_flops_per_token(config) -> int:
    """Forward FLOPs per token added to a vanilla decoder (whole model; ``h`` hidden,
    ``d_v`` value channels), per sublayer (``2L`` of them)::

        read     X r                2 h d_v
        gate     w_beta . x_in      2 h
        values   W_v x_in           2 h d_v
        k^T X                       2 h d_v
        update   X + k delta^T      2 h d_v

    i.e. ``8 h d_v + 2h``, plus the head's readout ``X r_out``, ``2 h d_v``. Left out: the
    RMS normalisations of ``k`` and ``x_in``, the sigmoids and the ``O(d_v)`` gate work.
    """
    h, dv = config.hidden_size, config.mixer.value_channels
    return 2 * config.unrolled_layers * (8 * h * dv + 2 * h) + 2 * h * dv


def extra_io_per_token(config) -> int:
    """Activation elements read and written per token beyond vanilla (whole model; ``h``
    hidden, ``d_v`` value channels), per sublayer: the read ``X r`` reads ``X`` (``h d_v``) and
    writes ``x_in`` (``h``); the delta update reads ``X`` and writes it (``2 h d_v``): ``3 h d_v
    + h`` less the vanilla residual add it replaces (``3h``). Plus the stem's replication and
    the head's readout, ``h (d_v + 1)`` each::

        2L (3 h d_v - 2h) + 2 h (d_v + 1)

    (``k``, ``beta`` and ``v`` are ``O(h + d_v)`` per sublayer and left out.)"""
    h, dv = config.hidden_size, config.mixer.value_channels
    return 2 * config.unrolled_layers * (3 * h * dv - 2 * h) + 2 * h * (dv + 1)


def extra_params(config, tp: int = 1) -> ExtraParams:
    """Per sublayer (two per stored layer), replicated: read vector ``d_v``, ``w_beta`` ``h``,
    ``b_beta`` 1, ``W_v`` ``d_v x h``, ``b_v`` ``d_v``: ``(d_v + 1) h + 2 d_v + 1``; the head's
    read vector ``r_out``, ``d_v``."""
    h, dv = config.hidden_size, config.mixer.value_channels
    return ExtraParams(layers=(2 * ((dv + 1) * h + 2 * dv + 1),) * config.num_layers, head=dv)


def saved_activations(config, tp: int, micro_batch: int) -> SavedActivations:
    """Per sublayer (two a layer; ``d_v`` value channels): the ``h x d_v`` state it reads,
    the write's input, output and key ``3h``, ``3 d_v + 4`` for the gates and 1/rms; the
    read-out saves the final state ``h d_v``. All on the sequence shard."""
    h, dv = config.hidden_size, config.mixer.value_channels
    t = tp if config.sequence_parallel else 1
    per = 2 * (h * dv + 3 * h + 3 * dv + 4) / t
    return SavedActivations(layers={u: per for u in range(config.unrolled_layers)},
                            head=h * dv / t)


def step_work(config, tokens: int) -> List[OpCall]:
    """Per sublayer the read ``X r`` and the delta update, as the ``ddl`` kernel op counts
    them (the update also reads ``F(x_in)``, ``x_in`` and keeps ``6 + 3 d_v`` fp32
    statistics a token); the stem's replication and the head's read-out."""
    t, h, dv = tokens, config.hidden_size, config.mixer.value_channels
    calls = []
    for i in range(1, 2 * config.unrolled_layers + 1):
        calls += [OpCall("ddl read", f"sublayer {i}", "ddl.read_work", (t, h, dv)),
                  OpCall("ddl update", f"sublayer {i}", "ddl.write_work", (t, h, dv))]
    return calls + [OpCall("ddl stem/head", "stem", "elementwise", (t * h, t * h * dv, 0)),
                    OpCall("ddl stem/head", "head", "elementwise",
                           (t * h * dv, t * h, 2 * t * h * dv))]


MIXER = Mixer(
    name="ddl", config_cls=DDLConfig, plan=ddl_plan,
    model_spec=model_hook(__name__, "get_ddl_model_spec"), kernels=("ddl",),
    extra_flops_per_token=extra_flops_per_token, extra_io_per_token=extra_io_per_token,
    extra_params=extra_params, saved_activations=saved_activations, step_work=step_work,
    variants=(
        Variant(checks=("accounting", "generate", "parity", "kernels")),
        Variant("vc3", {"value_channels": 3}, checks=("decode", "recompute", "transport")),
        Variant("vc2-swa3", {"value_channels": 2, "short_swa_window": 3}, checks=("decode",)),
        Variant("vc2-looped", {"value_channels": 2}, model=LOOPED, checks=("accounting",)),
    ))
