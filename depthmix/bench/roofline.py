"""Roofline floors of the kernel ops at their full benchmark shapes: the least time any
kernel could take on a given GPU, to judge a measured time against.

For each op, forward and backward, at each shape of ``cases(smoke=False)`` in its
``depthmix/bench/<op>.py`` (batch 1; its ``roofline_work`` counts them):

* **bytes**: every input read once and every output written once, at their dtypes (what
  a kernel with unlimited on-chip memory moves; re-reads from L2 or HBM are not counted);
* **FLOPs**: the arithmetic the math needs, not what a kernel recomputes, split into
  tensor-core work (the ops' ``tl.dot``) and the rest (fp32 on CUDA cores). A
  multiply-add is 2 FLOPs; an ``exp``, divide or compare counts 1. Each op's counting
  functions (``work``, ``read_work``, ...) say what they count.

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
# activations): the mixer lists them (its ``Mixer.step_work`` hook, ``OpCall``s), and each
# is counted as its kernel op's benchmark module counts it (``depthmix/bench/<op>.py``)
# where the op is one of ours, and by :func:`gemm` or :func:`elementwise` otherwise. The
# step's extra floor is the sum of every call's floor (each call is its own launch: their
# floors add, they do not overlap), times the micro-batches of a step on one rank. What is
# *not* subtracted: the vanilla residual adds some mixers replace (``3 h`` a token and
# sublayer, small against what they add), so the floor errs high, never low.


def gemm(t: int, k: int, n: int) -> Tuple[Work, Work]:
    """``[t, k] @ [k, n]`` in bf16: forward reads both, writes ``[t, n]``; backward reads
    the output gradient, both inputs and writes both gradients (``dX``, ``dW``)."""
    x, w, y = BF16 * t * k, BF16 * k * n, BF16 * t * n
    return (Work("", "", "fwd", x + w + y, tensor_flops=2 * t * k * n),
            Work("", "", "bwd", y + w + x + x + w, tensor_flops=4 * t * k * n))


def elementwise(read: float, write: float, flops: float) -> Tuple[Work, Work]:
    """An elementwise / reduction op of ``read`` and ``write`` bf16 elements and ``flops``
    fp32 FLOPs forward; backward reads the inputs and the output gradient, writes the input
    gradients and does twice the work."""
    return (Work("", "", "fwd", BF16 * (read + write), fp32_flops=flops),
            Work("", "", "bwd", BF16 * (2 * read + write), fp32_flops=2 * flops))


COUNTERS = {"gemm": gemm, "elementwise": elementwise}
"""The counters of op calls that are no kernel op of ours (``OpCall.counter``)."""


def counted(call) -> List[Work]:
    """Forward and backward :class:`Work` of one ``OpCall`` (``depthmix.mixers.base``):
    its counter, a function of :data:`COUNTERS` or ``<op>.<function>`` of the op's
    benchmark module, at its arguments, under its label and case."""
    if call.counter in COUNTERS:
        count = COUNTERS[call.counter]
    else:
        op, _, name = call.counter.partition(".")
        count = getattr(bench.hooks(op), name)
    return [Work(call.label, call.case, w.direction, w.bytes, w.tensor_flops, w.fp32_flops,
                 w.precision) for w in count(*call.args)]


def mixer_step_work(run, tokens: int) -> List[Work]:
    """Forward and backward :class:`Work` of every op call ``run``'s mixer adds to one
    micro-batch of ``tokens`` tokens (``case``: which layer, sublayer, DWA, ...): its
    ``Mixer.step_work`` hook, each call :func:`counted`. Vanilla: none. What each mixer
    counts is its hook's docstring (``depthmix/mixers/<method>/__init__.py``)."""
    from depthmix.mixers import mixer_of
    from depthmix.planning.shape import Shape

    return [w for call in mixer_of(run).step_work(Shape.of(run), tokens)
            for w in counted(call)]


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
