"""FLOPs, throughput/MFU and parameter counts.

FLOPs per token (2 FLOPs per multiply-add; ``L`` = unrolled layers = ``num_layers *
n_loops``, ``h`` hidden, ``f`` FFN, ``H``/``H_kv`` query/KV heads, ``d_h`` head dim,
``s`` sequence length, ``V`` padded vocabulary, ``w`` = ``mixer.short_swa_window``)::

    forward  = 2 * L * [ h*(H + 2*H_kv)*d_h      QKV projection
                       + H*d_h*h                 output projection
                       + 3*h*f ]                 SwiGLU MLP (gate, up, down)
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
form in its docstring (``depthmix/megatron_ext/mixers/<method>.py``).

Memory per pipeline rank (weights, gradients, optimizer state, saved activations,
pipeline buffers): :mod:`depthmix.planning.memory`.

Parameters: the vanilla layer (:func:`layer_params`), embedding, final norm and output
layer, plus ShortSWA's sublayer (:func:`short_swa_layer_params`) and what the mixer's
``extra_params(config, tp)`` hook reports per stored layer, next to the embedding (stem)
and next to the output layer (head); the dry run puts each on its pipeline stage.

MFU = (training FLOPs per token x tokens/s) / (world size x peak FLOP/s of one device),
with the peak from :data:`PEAK_TFLOPS` (dense, no sparsity) or ``train.peak_tflops``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

from depthmix.config.schema import RunConfig

# Dense tensor-core peak TFLOP/s per device, from the vendors' data sheets.
PEAK_TFLOPS = {
    # name fragment: {precision: TFLOP/s}
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
}


def device_peak_tflops(run: RunConfig, device_name: Optional[str] = None) -> Optional[float]:
    """``train.peak_tflops``, else the table entry for this device and precision, else None."""
    if run.train.peak_tflops:
        return float(run.train.peak_tflops)
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for fragment, peaks in PEAK_TFLOPS.items():  # most specific names first
        if fragment.lower() in device_name.lower():
            return peaks.get(run.train.precision)
    return None


# ---------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------


@dataclass
class Shape:
    """The numbers the formulas need, from the run config."""

    layers: int  # unrolled
    stored_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    vocab: int  # padded
    qk_norm: bool
    swa_window: int = 0  # mixer.short_swa_window (0: no ShortSWA sublayer)

    @classmethod
    def of(cls, run: RunConfig) -> "Shape":
        from depthmix.config.validate import padded_vocab_size

        m = run.model
        return cls(
            layers=m.num_layers * m.n_loops, stored_layers=m.num_layers,
            hidden=m.hidden_size, ffn=m.ffn_hidden_size,
            heads=m.num_attention_heads, kv_heads=m.num_query_groups,
            head_dim=m.head_dim or m.hidden_size // m.num_attention_heads,
            seq=m.seq_length,
            vocab=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by),
            qk_norm=m.qk_layernorm,
            swa_window=run.mixer.short_swa_window if run.mixer is not None else 0,
        )


def _mixer(run: RunConfig):
    from depthmix.mixers import get_mixer

    return get_mixer(run.mixer.name if run.mixer is not None else "vanilla")


def _plan_config(run: RunConfig):
    """What the mixers' hooks read, without Megatron (a ``DepthMixConfig`` works too)."""
    from depthmix.planning.shape import plan_config

    return plan_config(run)


def short_swa_flops_per_token(x: Shape) -> int:
    """ShortSWA's forward FLOPs per token, whole model (0 without it): per unrolled layer
    its QKV and output projections (as the layer's attention) and ``4 min(w, s) H d_h``
    for the window's scores and weighted values. Its RMSNorm is not counted."""
    if x.swa_window <= 0:
        return 0
    h, dh = x.hidden, x.head_dim
    return x.layers * (2 * h * (x.heads + 2 * x.kv_heads) * dh + 2 * x.heads * dh * h
                       + 4 * min(x.swa_window, x.seq) * x.heads * dh)


def flops_per_token(run: RunConfig, config=None) -> Dict[str, float]:
    """Forward FLOPs per token by part, and ``train`` = 3 x their sum (see module doc)."""
    x = Shape.of(run)
    h, dh = x.hidden, x.head_dim
    linear = 2 * x.layers * (h * (x.heads + 2 * x.kv_heads) * dh + x.heads * dh * h
                             + 3 * h * x.ffn)
    attention = 4 * x.layers * x.seq * x.heads * dh
    head = 2 * h * x.vocab
    hook = _mixer(run).extra_flops_per_token
    mixer = float(hook(config if config is not None else _plan_config(run)))
    swa = float(short_swa_flops_per_token(x))
    forward = linear + attention + head + mixer + swa
    return {"linear": float(linear), "attention": float(attention), "head": float(head),
            "mixer": mixer, "short_swa": swa, "forward": float(forward), "train": 3.0 * forward}


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
    def of(cls, run: RunConfig, config, world_size: int) -> "ThroughputMeter":
        return cls(flops_per_token(run, config)["train"], device_peak_tflops(run),
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


def memory_stats() -> Dict[str, float]:
    """GiB: peak allocated on the GPU (``mem/peak_alloc_gib``), or the process RSS on CPU."""
    import torch

    if torch.cuda.is_available():
        return {"mem/peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
                "mem/reserved_gib": torch.cuda.memory_reserved() / 2**30}
    try:
        import psutil

        return {"mem/rss_gib": psutil.Process().memory_info().rss / 2**30}
    except Exception:
        return {}


# ---------------------------------------------------------------------------------------
# Parameters and memory (the dry run)
# ---------------------------------------------------------------------------------------


def layer_params(x: Shape, tp: int) -> Dict[str, int]:
    """One decoder layer's parameters on one TP rank: ``sharded`` (split over TP) and
    ``replicated`` (norms)."""
    h, dh = x.hidden, x.head_dim
    sharded = h * (x.heads + 2 * x.kv_heads) * dh + x.heads * dh * h + 3 * h * x.ffn
    replicated = 2 * h + (2 * dh if x.qk_norm else 0)
    return {"sharded": sharded // tp, "replicated": replicated}


def short_swa_layer_params(x: Shape, tp: int) -> int:
    """ShortSWA's parameters in one decoder layer on one TP rank (0 without it): QKV and
    output projections (split over TP), its RMSNorm ``h`` and QK-norm ``2 d_h``."""
    if x.swa_window <= 0:
        return 0
    h, dh = x.hidden, x.head_dim
    sharded = h * (x.heads + 2 * x.kv_heads) * dh + x.heads * dh * h
    return sharded // tp + h + (2 * dh if x.qk_norm else 0)


def _stored_layer_params(x: Shape, tp: int, extra) -> List[int]:
    """Parameters of each stored layer on one TP rank: vanilla + ShortSWA + the mixer's."""
    if extra.layers and len(extra.layers) != x.stored_layers:
        raise ValueError(f"the mixer's extra_params gives {len(extra.layers)} layers for a "
                         f"model of {x.stored_layers} stored layers")
    per_layer = layer_params(x, tp)
    base = per_layer["sharded"] + per_layer["replicated"] + short_swa_layer_params(x, tp)
    return [base + extra.layer(i) for i in range(x.stored_layers)]


def _geometry(run: RunConfig, config, layout):
    """The transport's geometry: what crosses each stage boundary."""
    from depthmix.megatron_ext.transport import geometry_of

    return geometry_of(config, layout, run.parallel.tp)


def total_params(run: RunConfig, config=None) -> int:
    """All parameters of the model (unsharded, counted once)."""
    x = Shape.of(run)
    extra = _mixer(run).extra_params(config if config is not None else _plan_config(run), 1)
    return (sum(_stored_layer_params(x, 1, extra)) + extra.stem + extra.head
            + 2 * x.vocab * x.hidden + x.hidden)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}" if math.isfinite(n) else str(n)
