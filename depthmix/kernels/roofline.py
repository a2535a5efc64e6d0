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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

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
    kernel op), from each op's ``bench.roofline_work``."""
    from depthmix import kernels

    return [w for op in ops or kernels.ops() for w in kernels.bench(op).roofline_work()]
