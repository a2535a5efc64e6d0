"""FLOPs, throughput/MFU and parameter counts.

FLOPs per token (2 FLOPs per multiply-add; ``L`` = unrolled layers = ``num_layers *
n_loops``, ``h`` hidden, ``f`` FFN, ``H``/``H_kv`` query/KV heads, ``d_h`` head dim,
``s`` sequence length, ``V`` padded vocabulary, ``w`` = ``mixer.short_swa_window``)::

    forward  = 2 * L * [ h*(H + 2*H_kv)*d_h      QKV projection
                       + H*d_h*h                 output projection
                       + 3*h*f ]                 SwiGLU MLP (gate, up, down); on an MoE
                                                 layer the activated MLP instead: router
                                                 E*h + k*3*h*f_e + shared 3*h*f_s
             + 4 * L * s * H * d_h               attention scores QK^T and A.V
             + 2 * h * V                         LM head
             + mixer.extra_flops_per_token       the method's own work (its hook)
             + L * [ 2*h*(H + 2*H_kv)*d_h        ShortSWA, any mixer, when w > 0:
                   + 2*H*d_h*h                   its projections
                   + 4*min(w, s)*H*d_h ]         and its window's scores and A.V
    training = 3 * forward                       (backward = 2 x forward)

The attention term counts every (query, key) pair of the sequence, not only the causal
half: the convention of PaLM's MFU (``6N + 12*L*H*d_h*s``), Megatron-LM and torchtitan, so
our TFLOP/s and MFU compare with theirs; ShortSWA likewise counts ``min(w, s)`` keys per
query. The embedding lookup and norms are not counted; neither is activation recomputation
(this is model FLOPs utilisation, not hardware). Each mixer's hook documents its closed
form in its docstring (``depthmix/mixers/<method>/__init__.py``). With experts
(``model.moe``) FLOPs and MFU count the *activated* parameters, the top-k experts a token
is routed to (:mod:`depthmix.planning.experts`), never all of them.

Memory per pipeline rank (weights, gradients, optimizer state, saved activations,
pipeline buffers): :mod:`depthmix.planning.memory`.

Parameters: the vanilla layer (:func:`layer_params`; an MoE layer's MLP is its router,
routed experts and shared expert), embedding, final norm and output layer, plus
ShortSWA's sublayer (:func:`short_swa_layer_params`) and what the mixer's
``extra_params(config, tp)`` hook reports per stored layer, next to the embedding (stem)
and next to the output layer (head); the dry run puts each on its pipeline stage.
:func:`total_params` counts every expert, :func:`activated_params` the ``k`` a token runs
through; per TP x EP rank the routed experts are split over both
(:func:`stored_layer_params`).

MFU = (training FLOPs per token x tokens/s) / (world size x peak FLOP/s of one device),
with the peak from :mod:`depthmix.planning.hardware` or ``train.peak_tflops``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from depthmix.config.schema import RunConfig
from depthmix.planning import hardware
from depthmix.planning.experts import Experts
from depthmix.planning.shape import Shape


def device_peak_tflops(run: RunConfig, device_name: Optional[str]) -> Optional[float]:
    """``train.peak_tflops``, else the device table's peak for ``device_name`` (as
    ``torch.cuda.get_device_name()`` gives it; None: no GPU) and the run's precision."""
    if run.train.peak_tflops:
        return float(run.train.peak_tflops)
    device = hardware.device_named(device_name) if device_name else None
    return device.tflops.get(run.train.precision) if device else None


# ---------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------


def _attention_projections(x: Shape) -> int:
    """Weights of one attention's QKV and output projections (also ShortSWA's)."""
    return (x.hidden_size * (x.num_attention_heads + 2 * x.num_query_groups) * x.kv_channels
            + x.num_attention_heads * x.kv_channels * x.hidden_size)


def short_swa_flops_per_token(x: Shape) -> int:
    """ShortSWA's forward FLOPs per token, whole model (0 without it): per unrolled layer
    its QKV and output projections (as the layer's attention) and ``4 min(w, s) H d_h``
    for the window's scores and weighted values. Its RMSNorm is not counted."""
    w = x.short_swa_window
    if w <= 0:
        return 0
    return x.unrolled_layers * (2 * _attention_projections(x) + 4 * min(w, x.seq_length)
                                * x.num_attention_heads * x.kv_channels)


def flops_per_token(run: RunConfig, mixer, config=None) -> Dict[str, float]:
    """Forward FLOPs per token by part, and ``train`` = 3 x their sum (see module doc);
    ``moe``: the MoE layers' MLPs (router, top-k experts, shared expert), part of ``linear``.
    ``mixer``: the run's :class:`~depthmix.mixers.base.Mixer` (its hooks); ``config``: what
    its hook reads (a ``DepthMixConfig``; default the run's :class:`Shape`)."""
    x, moe = Shape.of(run), Experts.of(run)
    layers = x.unrolled_layers
    moe_layers = sum(moe.is_moe(u) for u in range(layers)) if moe else 0
    moe_flops = moe_layers * moe.forward_flops_per_token() if moe else 0
    dense_mlp = 2 * (layers - moe_layers) * 3 * x.hidden_size * x.ffn_hidden_size
    linear = 2 * layers * _attention_projections(x) + dense_mlp + moe_flops
    attention = 4 * layers * x.seq_length * x.num_attention_heads * x.kv_channels
    head = 2 * x.hidden_size * x.vocab_size
    extra = float(mixer.extra_flops_per_token(config if config is not None else x))
    swa = float(short_swa_flops_per_token(x))
    forward = linear + attention + head + extra + swa
    return {"linear": float(linear), "moe": float(moe_flops), "attention": float(attention),
            "head": float(head), "mixer": extra, "short_swa": swa, "forward": float(forward),
            "train": 3.0 * forward}


@dataclass
class Throughput:
    """Per-interval performance numbers for the log line and W&B."""

    seconds_per_step: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: Optional[float]

    def as_dict(self) -> dict:
        out = {"perf/step_time_s": self.seconds_per_step, "perf/tokens_per_s": self.tokens_per_s,
               "perf/tflops_per_device": self.tflops_per_device}
        if self.mfu is not None:
            out["perf/mfu"] = self.mfu
        return out


class ThroughputMeter:
    """The one source of tokens/s, TFLOP/s per device and MFU for every logger: the trainer
    adds each step's wall time (all ranks together) and reads the average at log steps."""

    def __init__(self, train_flops_per_token: float, peak_tflops: Optional[float],
                 tokens_per_step: int, world_size: int):
        self.train_flops_per_token, self.peak_tflops = train_flops_per_token, peak_tflops
        self.tokens_per_step, self.world_size = tokens_per_step, world_size
        self._seconds, self._steps = 0.0, 0

    @classmethod
    def of(cls, run: RunConfig, mixer, config, world_size: int,
           device_name: Optional[str]) -> "ThroughputMeter":
        return cls(flops_per_token(run, mixer, config)["train"],
                   device_peak_tflops(run, device_name),
                   run.train.global_batch_size * run.model.seq_length, world_size)

    def add(self, seconds: float) -> None:
        self._seconds += seconds
        self._steps += 1

    def read(self) -> Throughput:
        """Averaged over the steps added since the last reading."""
        seconds = self._seconds / max(self._steps, 1)
        self._seconds, self._steps = 0.0, 0
        tokens_per_s = self.tokens_per_step / seconds if seconds else 0.0
        tflops = self.train_flops_per_token * tokens_per_s / self.world_size / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        return Throughput(seconds, tokens_per_s, tflops, mfu)


# ---------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------


def layer_params(x: Shape, tp: int) -> Dict[str, int]:
    """One decoder layer's parameters on one TP rank: ``sharded`` (split over TP) and
    ``replicated`` (norms)."""
    sharded = _attention_projections(x) + 3 * x.hidden_size * x.ffn_hidden_size
    replicated = 2 * x.hidden_size + (2 * x.kv_channels if x.qk_layernorm else 0)
    return {"sharded": sharded // tp, "replicated": replicated}


def short_swa_layer_params(x: Shape, tp: int) -> int:
    """ShortSWA's parameters in one decoder layer on one TP rank (0 without it): QKV and
    output projections (split over TP), its RMSNorm ``h`` and QK-norm ``2 d_h``."""
    if x.short_swa_window <= 0:
        return 0
    return (_attention_projections(x) // tp + x.hidden_size
            + (2 * x.kv_channels if x.qk_layernorm else 0))


def stored_layer_params(x: Shape, tp: int, extra, moe: Optional[Experts] = None,
                        ep: int = 1) -> List[int]:
    """Parameters of each stored layer on one TP (x EP) rank: vanilla + ShortSWA + the
    mixer's (``extra``: its :class:`~depthmix.mixers.base.ExtraParams`); an MoE layer's
    MLP (``moe``) is its router, ``E / ep`` routed experts and the shared expert."""
    if extra.layers and len(extra.layers) != x.num_layers:
        raise ValueError(f"the mixer's extra_params gives {len(extra.layers)} layers for a "
                         f"model of {x.num_layers} stored layers")
    per_layer = layer_params(x, tp)
    base = per_layer["sharded"] + per_layer["replicated"] + short_swa_layer_params(x, tp)
    out = []
    for i in range(x.num_layers):
        mlp = 0
        if moe is not None and moe.is_moe(i):
            mlp = (moe.router_params() + moe.expert_params(tp, ep) + moe.shared_params(tp)
                   - 3 * x.hidden_size * x.ffn_hidden_size // tp)
        out.append(base + mlp + extra.layer(i))
    return out


def stored_layer_expert_params(x: Shape, moe: Optional[Experts], tp: int = 1,
                               ep: int = 1) -> List[int]:
    """The routed experts' parameters of each stored layer on one TP x EP rank (part of
    :func:`stored_layer_params`; their gradients reduce over the expert-data-parallel
    group, their optimizer state shards over it)."""
    return [moe.expert_params(tp, ep) if moe is not None and moe.is_moe(i) else 0
            for i in range(x.num_layers)]


def total_params(run: RunConfig, mixer, config=None) -> int:
    """All parameters of the model of ``run`` and its ``mixer`` (unsharded, counted once;
    every expert)."""
    x = Shape.of(run)
    extra = mixer.extra_params(config if config is not None else x, 1)
    return (sum(stored_layer_params(x, 1, extra, Experts.of(run))) + extra.stem + extra.head
            + (1 if x.tie_embeddings else 2) * x.vocab_size * x.hidden_size + x.hidden_size)


def activated_params(run: RunConfig, mixer, config=None) -> int:
    """The parameters one token runs through: :func:`total_params` with each MoE layer's
    routed experts cut to the ``k`` it is routed to (the same as the total without
    experts)."""
    moe = Experts.of(run)
    total = total_params(run, mixer, config)
    if moe is None:
        return total
    idle = (moe.experts - moe.top_k) * 3 * moe.hidden * moe.ffn
    return total - idle * sum(moe.moe_layers)
