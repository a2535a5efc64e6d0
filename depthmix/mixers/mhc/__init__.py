"""``mixer=mhc`` without its model code: options, plan and cost.

The method (Hyper-Connections and mHC) and its Megatron modules are described in
:mod:`depthmix.mixers.mhc.model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, List, Tuple

from depthmix.mixers.base import ExtraParams, Mixer, MixerConfig, Variant, model_hook
from depthmix.mixers.base import OpCall, SavedActivations
from depthmix.kernels.modes import MHC_VARIANTS as VARIANTS
from depthmix.planning.depth_plan import STEM, Entry

STREAMS = "streams"
"""Depth-state name of the ``n`` residual streams ``[s, b, n, h]``."""


def coefficient_width(variant: str, n: int) -> int:
    """Number of coefficient logits ``m`` per token: ``2n + n^2`` (``2n`` for identity)."""
    return 2 * n if variant == "identity" else 2 * n + n * n


@dataclass
class MHCConfig(MixerConfig):
    """``mixer=mhc``: multi-stream residual connections."""

    CHOICES: ClassVar[Dict[str, Tuple[str, ...]]] = {**MixerConfig.CHOICES,
                                                     "variant": VARIANTS}

    name: str = "mhc"
    variant: str = "mhc"
    """``mhc`` (Sinkhorn-constrained H_res), ``hc`` (unconstrained, tanh), ``identity``
    (H_res = I)."""
    streams: int = 4
    """Number of residual streams ``n`` (the papers' expansion rate; the Depth-Attention paper
    uses 4)."""
    sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations for H_res (``variant=mhc``)."""
    gate_init: float = 0.01
    """Initial value of the gates alpha scaling the dynamic coefficients."""

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        self.check_at_least("streams", 1)
        self.check_at_least("sinkhorn_iters", 1)
        self.check_pre_norm(model)


def mhc_plan(config, tp: int) -> List[Entry]:
    """One entry: the streams, written by the stem and every layer, read by every layer and
    the head; ``n * hidden`` per token on the sequence-parallel shard (independent of TP)."""
    n = config.unrolled_layers
    return [Entry(STREAMS, writers=(STEM, *range(n)), readers=(*range(n), n),
                  shape=(config.mixer.streams, config.hidden_size), seq_sharded=True)]


def extra_flops_per_token(config) -> int:
    """Forward FLOPs per token added to a vanilla decoder (whole model; ``n`` streams,
    ``h`` hidden, ``m = n^2 + 2n`` coefficients, ``2n`` for ``identity``), per sublayer
    (``2L`` of them)::

        coefficient projection  2 n h m      RMSNorm(flatten X) @ phi
        pre-mix                 2 n h        H_pre X
        res-mix                 2 n^2 h      H_res X      (not for identity: H_res = I)
        post                    2 n h        + H_post^T F(x_in)

    plus the head's mean over the streams, ``2 n h``. Left out: the RMSNorm of ``X``
    (``~3nh``), gates and activations, Sinkhorn-Knopp (``~4 n^2`` per iteration).
    """
    mc = config.mixer
    n, h = mc.streams, config.hidden_size
    m = coefficient_width(mc.variant, n)
    res = 0 if mc.variant == "identity" else 2 * n * n * h
    sublayer = 2 * n * h * m + 2 * n * h + res + 2 * n * h
    return 2 * config.unrolled_layers * sublayer + 2 * n * h


def extra_io_per_token(config) -> int:
    """Activation elements read and written per token beyond vanilla (whole model; ``n``
    streams, ``h`` hidden), per sublayer: the coefficients and ``H_pre X`` each read ``X``
    (``2nh``) and write ``x_in`` (``h``); the post/res update reads ``X`` and ``F(x_in)`` and
    writes ``X`` (``2nh + h``): ``4nh + 2h``, less the vanilla residual add it replaces
    (read ``h`` and ``y``, write ``h``: ``3h``). Plus the stem's copy into ``n`` streams and
    the head's mean, ``(n + 1) h`` each::

        2L (4nh - h) + 2 (n + 1) h
    """
    n, h = config.mixer.streams, config.hidden_size
    return 2 * config.unrolled_layers * (4 * n * h - h) + 2 * (n + 1) * h


def extra_params(config, tp: int = 1) -> ExtraParams:
    """Per sublayer (two per stored layer), replicated: ``phi`` ``n h x m``, the gates
    (3; 2 for ``identity``) and the static biases ``m``. Stem and head have none."""
    mc = config.mixer
    n, h = mc.streams, config.hidden_size
    m = coefficient_width(mc.variant, n)
    gates = 2 if mc.variant == "identity" else 3
    return ExtraParams(layers=(2 * (n * h * m + gates + m),) * config.num_layers)


def saved_activations(config, tp: int, micro_batch: int) -> SavedActivations:
    """Per hyper-connection (two a layer; ``n`` streams, ``K`` Sinkhorn iterations for
    ``variant=mhc``, else 0): the widened input and its norm ``2 n h``, the read-out ``h``,
    the coefficient logits ``n (n + 2)`` and their 1/rms, ``n^2 + 2n + 1``, and Sinkhorn's
    ``n^2 (2K + 1) + n (2K + 2)``. All on the sequence shard."""
    m = config.mixer
    n, h, k = m.streams, config.hidden_size, m.sinkhorn_iters if m.variant == "mhc" else 0
    per = (n * n * (2 * k + 1) + n * (2 * k + 2) + 2 * n * h + h + n * (n + 2)
           + n * n + 2 * n + 1)
    t = tp if config.sequence_parallel else 1
    return SavedActivations(layers={u: 2 * per / t for u in range(config.unrolled_layers)})


def step_work(config, tokens: int) -> List[OpCall]:
    """Per sublayer the read (coefficients, Sinkhorn, ``H_pre X``) and the post/res
    update, as the ``mhc`` kernel op counts them; the stem's copy into ``n`` streams and
    the head's mean."""
    mc, t, h = config.mixer, tokens, config.hidden_size
    n, m = mc.streams, coefficient_width(mc.variant, mc.streams)
    iters = mc.sinkhorn_iters if mc.variant == "mhc" else 0
    calls = []
    for i in range(1, 2 * config.unrolled_layers + 1):
        calls += [OpCall("mhc read", f"sublayer {i}", "mhc.read_work", (t, n, h, m, iters)),
                  OpCall("mhc post/res", f"sublayer {i}", "mhc.post_res_work", (t, n, h))]
    return calls + [OpCall("mhc stem/head", "stem", "elementwise", (t * h, t * n * h, 0)),
                    OpCall("mhc stem/head", "head", "elementwise", (t * n * h, t * h, t * n * h))]


MIXER = Mixer(
    name="mhc", config_cls=MHCConfig, plan=mhc_plan,
    model_spec=model_hook(__name__, "get_mhc_model_spec"), kernels=("mhc",),
    extra_flops_per_token=extra_flops_per_token, extra_io_per_token=extra_io_per_token,
    extra_params=extra_params, saved_activations=saved_activations, step_work=step_work,
    variants=(
        Variant(checks=("accounting", "generate")),
        Variant("n3", {"streams": 3}, checks=("decode", "recompute")),
        Variant("hc-n3", {"variant": "hc", "streams": 3},
                checks=("decode", "recompute", "accounting")),
        Variant("identity-n3", {"variant": "identity", "streams": 3},
                checks=("decode", "recompute")),
        Variant("n2-swa3", {"streams": 2, "short_swa_window": 3}, checks=("decode",)),
        Variant("hc-n2-swa3", {"variant": "hc", "streams": 2, "short_swa_window": 3},
                checks=("decode",)),
        Variant("identity-swa5", {"variant": "identity", "short_swa_window": 5},
                checks=("accounting",)),
        Variant("n4", {"streams": 4}, checks=("transport",)),
        Variant("n2", {"streams": 2}, checks=("parity", "kernels")),
    ))
