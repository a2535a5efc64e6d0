"""Roofline floors of the kernel ops at their full benchmark shapes: the least time any
kernel could take on a given GPU, to judge a measured time against.

For each op, forward and backward, at each shape of ``cases(smoke=False)`` in its
``bench.py`` (batch 1; its ``roofline_work`` counts them):

* **bytes**: every input read once and every output written once, at their dtypes (what
  a kernel with unlimited on-chip memory moves; re-reads from L2 or HBM are not counted);
* **FLOPs**: the arithmetic the math needs, not what a kernel recomputes, split into
  tensor-core work (the ops' ``tl.dot``) and the rest (fp32 on CUDA cores). A
  multiply-add is 2 FLOPs; an ``exp``, divide or compare counts 1. Each op's ``_work``
  says what it counts.

``floor = max(bytes / HBM bandwidth, tensor FLOPs / tensor peak, other FLOPs / fp32
peak)``; the largest term names the bound (``memory``, ``tensor``, ``fp32``).

Peaks and bandwidths (dense, no sparsity) are the device table's
(:mod:`depthmix.planning.hardware`). mHC's projections run their fp32 operands as
``tf32x3`` (three TF32 products each), so their peak is a third of TF32's.

The same counts over a whole training step (:func:`step_extra_floor`): every op a mixer
adds to the vanilla step at the step's shapes, summed over layers, forward and backward --
what ``tools/gpu_bench.py`` sets beside each mixer's measured step
(``step <= vanilla + 1.5 x extra floor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from depthmix import bench
from depthmix.planning.hardware import H100, Device

BF16, FP32 = 2, 4  # bytes per element


def tensor_flops(device: Device, precision: str) -> float:
    """Peak FLOP/s of the tensor cores for ``tl.dot`` inputs of ``precision``."""
    if precision == "tf32x3":
        return device.tflops["tf32"] * 1e12 / 3
    return device.tflops[precision] * 1e12


@dataclass(frozen=True)
class Work:
    """What one pass (``fwd`` or ``bwd``) of an op must do at one shape."""

    op: str
    case: str
    direction: str
    bytes: float
    tensor_flops: float = 0.0
    fp32_flops: float = 0.0
    precision: str = "bf16"
    """Input precision of the tensor-core work."""

    @property
    def flops(self) -> float:
        return self.tensor_flops + self.fp32_flops

    def floor(self, device: Device = H100) -> Tuple[float, str]:
        """``(seconds, bound)`` on ``device``."""
        terms = {"memory": self.bytes / (device.hbm_tb_s * 1e12),
                 "tensor": self.tensor_flops / tensor_flops(device, self.precision),
                 "fp32": self.fp32_flops / (device.tflops["fp32"] * 1e12)}
        bound = max(terms, key=terms.get)
        return terms[bound], bound


def label_pairs(cases: List[Tuple[str, Tuple[Work, Work]]]) -> List[Work]:
    """``(case label, (fwd, bwd))`` pairs as labelled :class:`Work`."""
    return [Work(w.op, label, w.direction, w.bytes, w.tensor_flops, w.fp32_flops, w.precision)
            for label, pair in cases for w in pair]


def all_work(ops: Sequence[str] = ()) -> List[Work]:
    """Forward and backward of every full benchmark shape of ``ops`` (default: every
    kernel op), from each op's ``roofline_work``."""
    from depthmix import kernels

    return [w for op in ops or kernels.ops() for w in bench.hooks(op).roofline_work()]


# ---------------------------------------------------------------------------------------
# A whole training step: what a mixer adds to the vanilla step (issue 37)
# ---------------------------------------------------------------------------------------
#
# Every op call a mixer adds to one micro-batch, forward and backward, at the step's shapes
# (``T`` = micro-batch x sequence tokens, the run's heads, head dim and hidden size, bf16
# activations), counted as the kernel ops' own ``_work`` counts them where the op is one of
# ours (``depth_mix``, ``moda_attention``, ``attnres``, ``mhc``, ``ddl``), and here otherwise. The
# step's extra floor is the sum of every call's floor (each call is its own launch: their
# floors add, they do not overlap), times the micro-batches of a step on one rank. What is
# *not* subtracted: the vanilla residual adds some mixers replace (``3 h`` a token and
# sublayer, small against what they add), so the floor errs high, never low.


def _minus(a: Work, b: Work) -> Work:
    return Work(a.op, a.case, a.direction, a.bytes - b.bytes, a.tensor_flops - b.tensor_flops,
                a.fp32_flops - b.fp32_flops, a.precision)


def _named(op: str, case: str, pair) -> List[Work]:
    return [Work(op, case, w.direction, w.bytes, w.tensor_flops, w.fp32_flops, w.precision)
            for w in pair]


def _gemm(t: int, k: int, n: int) -> Tuple[Work, Work]:
    """``[t, k] @ [k, n]`` in bf16: forward reads both, writes ``[t, n]``; backward reads
    the output gradient, both inputs and writes both gradients (``dX``, ``dW``)."""
    x, w, y = BF16 * t * k, BF16 * k * n, BF16 * t * n
    return (Work("", "", "fwd", x + w + y, tensor_flops=2 * t * k * n),
            Work("", "", "bwd", y + w + x + x + w, tensor_flops=4 * t * k * n))


def _elementwise(read: float, write: float, flops: float) -> Tuple[Work, Work]:
    """An elementwise / reduction op of ``read`` and ``write`` bf16 elements and ``flops``
    fp32 FLOPs forward; backward reads the inputs and the output gradient, writes the input
    gradients and does twice the work."""
    return (Work("", "", "fwd", BF16 * (read + write), fp32_flops=flops),
            Work("", "", "bwd", BF16 * (2 * read + write), fp32_flops=2 * flops))


def mixer_step_work(run, tokens: int) -> List[Work]:
    """Forward and backward :class:`Work` of every op call ``run``'s mixer adds to one
    micro-batch of ``tokens`` tokens (``case``: which layer, sublayer, DWA, ...). Vanilla:
    none. What each op counts (beyond the kernel ops' docstrings):

    * ``depth_attn``: one ``depth_mix`` per layer with ``|S(l)| > 0`` sources (softmax over
      the sources' keys, mixed values: the kernel benchmark's options);
    * ``moda``: per layer, ``moda_attention`` with the ``D_l`` depth entries it reads less
      the same kernel with none (the plain causal attention vanilla runs), and one
      ``h x 2 H_kv d_h`` GEMM per projected depth entry (:func:`_gemm`);
    * ``attnres_*``: one ``attnres`` read per sublayer and the head over its ``S_i`` sources;
    * ``mhc``: per sublayer the read (coefficients, Sinkhorn, ``H_pre X``) and the post/res
      update, and the stem's copy into ``n`` streams and the head's mean;
    * ``denseformer``: per DWA the weighted sum of its ``|S(i)|`` sources (read them, write
      the average; backward ``dY`` and the sources in, their gradients out);
    * ``ddl``: per sublayer the read ``X r`` and the delta update, as the ``ddl`` kernel
      op counts them (the update also reads ``F(x_in)``, ``x_in`` and keeps ``6 + 3 d_v``
      fp32 statistics a token); the stem's replication and the head's read-out.
    """
    from depthmix import kernels
    from depthmix.planning.shape import Shape

    x = Shape.of(run)
    name = run.mixer.name if run.mixer is not None else "vanilla"
    t, h = tokens, x.hidden_size
    heads, ng, hd = x.num_attention_heads, x.num_query_groups, x.kv_channels
    out: List[Work] = []
    if name == "depth_attn":
        from depthmix.mixers.depth_attn import DepthSchedule

        schedule, work = DepthSchedule.from_config(x), bench.hooks("depth_mix")._work
        for u in range(x.unrolled_layers):
            if schedule.sources(u):
                out += _named("depth_mix", f"layer {u}",
                              work(t, heads, heads // ng, hd, len(schedule.sources(u))))
    elif name == "moda":
        from depthmix.mixers.moda import MoDAGeometry, _projects

        geo, work = MoDAGeometry.from_config(x), bench.hooks("moda_attention")._work
        for u in range(geo.unrolled):
            depth = len(geo.visible(u))
            if depth:
                with_depth, plain = work(t, heads, heads // ng, hd, depth), work(
                    t, heads, heads // ng, hd, 0)
                out += _named("moda depth entries", f"layer {u}",
                              [_minus(a, b) for a, b in zip(with_depth, plain)])
        for s in geo.stored_sources():
            if _projects(x, s.kind):
                out += _named("moda kv projection", f"{s.name}", _gemm(t, h, 2 * ng * hd))
    elif name in ("attnres_full", "attnres_block"):
        from depthmix.mixers.attnres import AttnResGeometry

        geo, work = AttnResGeometry.from_config(x), bench.hooks("attnres")._work
        for i in range(1, geo.head + 1):
            where = "head" if i == geo.head else f"sublayer {i}"
            out += _named("attnres", where, work(t, h, len(geo.sources(i))))
    elif name == "mhc":
        from depthmix.mixers.mhc import coefficient_width

        ops, mc = bench.hooks("mhc"), run.mixer
        n, m = mc.streams, coefficient_width(mc.variant, mc.streams)
        iters = mc.sinkhorn_iters if mc.variant == "mhc" else 0
        for i in range(1, 2 * x.unrolled_layers + 1):
            out += _named("mhc read", f"sublayer {i}", ops._mhc_read(t, n, h, m, iters))
            out += _named("mhc post/res", f"sublayer {i}", ops._mhc_post_res(t, n, h))
        out += _named("mhc stem/head", "stem", _elementwise(t * h, t * n * h, 0))
        out += _named("mhc stem/head", "head", _elementwise(t * n * h, t * h, t * n * h))
    elif name == "denseformer":
        from depthmix.mixers.denseformer import DWAGeometry

        geo = DWAGeometry.from_config(x)
        for i in range(1, geo.num_blocks + 1):
            if geo.has_dwa(i):
                s = len(geo.sources(i))
                fwd, bwd = _elementwise(t * h * s, t * h, 2 * t * h * s)
                bwd = Work("", "", "bwd", BF16 * t * h * (1 + 2 * s), fp32_flops=4 * t * h * s)
                out += _named("dwa", f"block {i}", (fwd, bwd))
    elif name == "ddl":
        ops, dv = bench.hooks("ddl"), run.mixer.value_channels
        for i in range(1, 2 * x.unrolled_layers + 1):
            out += _named("ddl read", f"sublayer {i}", ops._read_work(t, h, dv))
            out += _named("ddl update", f"sublayer {i}", ops._write_work(t, h, dv))
        out += _named("ddl stem/head", "stem", _elementwise(t * h, t * h * dv, 0))
        out += _named("ddl stem/head", "head", _elementwise(t * h * dv, t * h, 2 * t * h * dv))
    elif name != "vanilla":
        raise ValueError(f"no step roofline for mixer {name!r}: add its ops to "
                         "depthmix.bench.roofline.mixer_step_work")
    return out


@dataclass
class StepFloor:
    """The least time a mixer's own ops add to one training step on one rank."""

    device: str
    micro_batches: int
    """Per step on one rank; every op runs once per micro-batch."""
    ops: dict
    """Op -> ``calls`` (per micro-batch), ``bytes``, ``tensor_flops``, ``fp32_flops`` (per
    step), ``fwd_s``, ``bwd_s`` (floors per step) and ``bound`` (of its largest call)."""

    @property
    def seconds(self) -> float:
        return sum(o["fwd_s"] + o["bwd_s"] for o in self.ops.values())

    def as_dict(self) -> dict:
        return {"device": self.device, "micro_batches": self.micro_batches,
                "ms": self.seconds * 1e3,
                "ops": {k: {**v, "fwd_ms": v["fwd_s"] * 1e3, "bwd_ms": v["bwd_s"] * 1e3}
                        for k, v in self.ops.items()}}


def step_extra_floor(run, device: Device = H100) -> StepFloor:
    """:func:`mixer_step_work` of one micro-batch (``train.micro_batch_size`` sequences),
    floored call by call on ``device`` and summed over the micro-batches of one step on one
    rank (``global_batch_size / (micro_batch_size x dp)``; ``parallel.dp`` or 1)."""
    t = run.train
    dp = getattr(run.parallel, "dp", None) or 1
    micro = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    ops: dict = {}
    for w in mixer_step_work(run, t.micro_batch_size * run.model.seq_length):
        o = ops.setdefault(w.op, {"calls": 0, "bytes": 0.0, "tensor_flops": 0.0,
                                  "fp32_flops": 0.0, "fwd_s": 0.0, "bwd_s": 0.0,
                                  "bound": None, "_largest": -1.0})
        seconds, bound = w.floor(device)
        o["calls"] += w.direction == "fwd"
        o["bytes"] += w.bytes * micro
        o["tensor_flops"] += w.tensor_flops * micro
        o["fp32_flops"] += w.fp32_flops * micro
        o[f"{w.direction}_s"] += seconds * micro
        if seconds > o["_largest"]:
            o["_largest"], o["bound"] = seconds, bound
    for o in ops.values():
        del o["_largest"]
    return StepFloor(device.name, micro, ops)
