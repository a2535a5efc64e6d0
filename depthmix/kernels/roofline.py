"""Roofline floors of the four ops at their full benchmark shapes: the least time any
kernel could take on a given GPU, to judge a measured time against.

For each op, forward and backward, at each shape of ``cases(smoke=False)`` in its
``bench.py`` (batch 1):

* **bytes**: every input read once and every output written once, at their dtypes (what
  a kernel with unlimited on-chip memory moves; re-reads from L2 or HBM are not counted);
* **FLOPs**: the arithmetic the math needs, not what a kernel recomputes, split into
  tensor-core work (the ops' ``tl.dot``) and the rest (fp32 on CUDA cores). A
  multiply-add is 2 FLOPs; an ``exp``, divide or compare counts 1. Each ``_<op>``
  function says what it counts.

``floor = max(bytes / HBM bandwidth, tensor FLOPs / tensor peak, other FLOPs / fp32
peak)``; the largest term names the bound (``memory``, ``tensor``, ``fp32``).

Peaks and bandwidths (dense, no sparsity) are the device table's
(:mod:`depthmix.planning.hardware`). mHC's projections run their fp32 operands as
``tf32x3`` (three TF32 products each), so their peak is a third of TF32's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

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


# ---------------------------------------------------------------------------------------
# depth_mix: Depth-Attention's depth step, mix_rule=softmax, mixed_state=value
# ---------------------------------------------------------------------------------------


def _depth_mix(t: int, heads: int, g: int, d: int, s: int) -> Tuple[Work, Work]:
    """Per token and KV head (``ng = heads / G``), ``S`` sources plus the layer itself:
    group mean of ``G`` query heads (``(G + 1) d``), ``S + 1`` scores (``2d`` each) and
    softmax (5 each), the weighted value sum (``2d`` each) and its normalisation (``d``).
    Backward: the mean again, the scores, ``da_j = dv_out . v_j`` (``2d``), ``dq`` and
    ``dk_j`` from ``dz_j`` (``3d``), ``dv_j = a_j dv_out`` (``d``) and the ``G`` copies of
    ``dq``. Reads/writes: forward q, k, v, S source keys and values -> mixed value, fp32
    lse; backward those inputs, lse, the value gradient -> gradients of all of them."""
    ng = heads // g
    rows = t * ng  # (token, KV head) pairs
    ins = BF16 * t * d * (heads + (2 + 2 * s) * ng)
    fwd = Work("depth_mix", "", "fwd", ins + BF16 * rows * d + FP32 * rows,
               fp32_flops=rows * (d * (g + 1) + (s + 1) * (4 * d + 5) + d))
    bwd = Work("depth_mix", "", "bwd", 2 * ins + BF16 * rows * d + FP32 * rows,
               fp32_flops=rows * (d * (g + 2) + (s + 1) * (8 * d + 10)))
    return fwd, bwd


def depth_mix_work() -> List[Work]:
    from depthmix.kernels.depth_mix import bench

    return _label([(f"T{x.t}-G{x.g}-hd{x.head_dim}",
                    _depth_mix(x.t, x.heads, x.g, x.head_dim, x.sources))
                   for x in bench.shapes(smoke=False)])


# ---------------------------------------------------------------------------------------
# moda_attention: causal sequence attention + same-position depth entries, one softmax
# ---------------------------------------------------------------------------------------


def _moda(t: int, heads: int, g: int, d: int, depth: int) -> Tuple[Work, Work]:
    """Scores a query row sees: ``(T + 1) / 2`` causal keys on average plus its ``D`` depth
    entries; useful pairs ``P = heads (T (T + 1) / 2 + T D)`` (masked and padded tile
    entries are not counted). Tensor FLOPs: ``QK^T`` and ``PV`` forward (``4 d P``); five
    products backward (``QK^T`` again, ``dO V^T``, ``P^T dO``, ``dS^T Q``, ``dS K``:
    ``10 d P``; our kernels recompute ``QK^T`` and ``dO V^T`` once more, in the dK/dV and
    the dQ kernel). fp32: 4 per score forward (scale, max, exp, sum), 5 backward (exp,
    ``P (dP - delta)``), and ``delta = rowsum(dO * O)``. Bytes: q, k, v, depth k/v -> o,
    fp32 lse per row; backward those, o, dO, lse -> the five gradients."""
    ng = heads // g
    pairs = heads * (t * (t + 1) / 2 + t * depth)
    qo = BF16 * t * heads * d  # one [T, heads, d] tensor
    kv = BF16 * t * ng * d * (2 + 2 * depth)  # k, v and the depth k, v
    lse = FP32 * t * heads
    fwd = Work("moda_attention", "", "fwd", qo + kv + qo + lse,
               tensor_flops=4 * d * pairs, fp32_flops=4 * pairs)
    bwd = Work("moda_attention", "", "bwd", 3 * qo + kv + lse + qo + kv,
               tensor_flops=10 * d * pairs, fp32_flops=5 * pairs + 2 * t * heads * d)
    return fwd, bwd


def moda_work() -> List[Work]:
    from depthmix.kernels.moda_attention import bench

    shapes = [(f"T{x.t}-G{x.g}-hd{x.head_dim}-D{x.depth}", x) for x in bench.shapes(False)]
    shapes += [(f"paper row {row[0]}: T{x.t}-G{x.g}-hd{x.head_dim}-D{x.depth}-np{x.heads}", x)
               for row, x in zip(bench.PAPER_ROWS, bench.paper_shapes())]
    return _label([(label, _moda(x.t, x.heads, x.g, x.head_dim, x.depth))
                   for label, x in shapes])


# ---------------------------------------------------------------------------------------
# attnres: one softmax over S sources with a static pseudo-query
# ---------------------------------------------------------------------------------------


def _attnres(t: int, d: int, s: int) -> Tuple[Work, Work]:
    """Per source and token: sum of squares and the query dot (``4d``), the online
    accumulation (``3d``); the output normalisation ``d`` per token. Backward per source:
    the pre-norm output again (``2d``), ``y . dout`` (``2d``), ``dy`` (``5d``), the query
    gradient's sum (``2d``); ``o . dout`` per token. Bytes: the sources, query and gain ->
    output and fp32 ``z``, ``rstd`` (per source and token), ``lse``; backward the sources,
    parameters, output gradient and statistics -> the source and parameter gradients."""
    sources = BF16 * s * t * d
    stats = FP32 * (2 * s * t + t)
    params = BF16 * 2 * d
    fwd = Work("attnres", "", "fwd", sources + params + BF16 * t * d + stats,
               fp32_flops=t * (s * (7 * d + 10) + d))
    bwd = Work("attnres", "", "bwd", sources + params + BF16 * t * d + stats + sources + params,
               fp32_flops=t * (s * (11 * d + 10) + 2 * d))
    return fwd, bwd


def attnres_work() -> List[Work]:
    from depthmix.kernels.attnres import bench

    return _label([(f"{x.kind} T{x.t}-S{x.sources}-h{x.hidden}", _attnres(x.t, x.hidden, x.sources))
                   for x in bench.shapes(smoke=False)])


# ---------------------------------------------------------------------------------------
# mhc: Sinkhorn alone, the read (launch 1) and post/res (launch 2)
# ---------------------------------------------------------------------------------------


def _sinkhorn_flops(n: int, iters: int) -> Tuple[int, int]:
    """Per matrix: forward (row max, ``exp``: ``3 n^2``; each iteration two sums and two
    divisions, ``4 n^2``) and backward through stored iterates (one forward to get them,
    ``8 n^2`` per iteration, the final ``* e0``). Our kernel stores nothing and recomputes
    ``K (K - 1) / 2`` iterations instead (190 for ``K = 20``), about 4x this backward."""
    fwd = 3 * n * n + 4 * iters * n * n
    return fwd, fwd + 8 * iters * n * n + n * n


def _sinkhorn(t: int, n: int, iters: int) -> Tuple[Work, Work]:
    """fp32 logits ``[T, n, n]`` -> fp32 ``[T, n, n]``; backward logits and gradient in,
    gradient out."""
    fwd_flops, bwd_flops = _sinkhorn_flops(n, iters)
    mat = FP32 * t * n * n
    return (Work("mhc", "", "fwd", 2 * mat, fp32_flops=t * fwd_flops),
            Work("mhc", "", "bwd", 3 * mat, fp32_flops=t * bwd_flops))


def _mhc_read(t: int, n: int, h: int, m: int, iters: int) -> Tuple[Work, Work]:
    """Tensor (``tf32x3``): the projection ``X phi`` (``2 n h m`` per token) forward,
    ``dd phi^T`` and ``X^T dd`` backward. fp32 per token: sum of squares and ``H_pre X``
    (``2 n h`` each), about 10 per coefficient, Sinkhorn (:func:`_sinkhorn_flops`);
    backward ``X . dx_in`` (``2 n h``), the ``dX`` terms (``4 n h``), about 20 per
    coefficient. Bytes: streams, ``phi``, gates, biases -> ``x_in``, ``H_pre``, ``H_post``,
    ``H_res`` and the saved logits and ``rstd`` (fp32); backward those inputs, the saved
    statistics and the four output gradients -> ``dX``, ``dphi``, gates, biases."""
    sink_fwd, sink_bwd = _sinkhorn_flops(n, iters)
    streams, params = BF16 * t * n * h, BF16 * (n * h * m + 3 + m)
    coefs = FP32 * t * (2 * n + n * n)  # H_pre, H_post, H_res
    saved = FP32 * t * (m + 1)  # dynamic logits, rstd
    fwd = Work("mhc", "", "fwd", streams + params + BF16 * t * h + coefs + saved,
               tensor_flops=2 * t * n * h * m, fp32_flops=t * (4 * n * h + 10 * m + sink_fwd),
               precision="tf32x3")
    bwd = Work("mhc", "", "bwd",
               streams + params + FP32 * t * n + saved + BF16 * t * h + coefs + streams + params,
               tensor_flops=4 * t * n * h * m, fp32_flops=t * (6 * n * h + 20 * m + sink_bwd),
               precision="tf32x3")
    return fwd, bwd


def _mhc_post_res(t: int, n: int, h: int) -> Tuple[Work, Work]:
    """``X' = H_res X + H_post^T y``: ``2 (n + 1)`` FLOPs per output element; backward
    ``dy``, ``dX``, ``dH_post``, ``dH_res``: ``4 n (n + 1) h`` per token. Bytes: streams,
    ``y`` (bf16), fp32 coefficients -> new streams; backward those and the stream gradient
    -> gradients of all four."""
    streams, y = BF16 * t * n * h, BF16 * t * h
    coefs = FP32 * t * (n + n * n)
    fwd = Work("mhc", "", "fwd", streams + y + coefs + streams,
               fp32_flops=2 * (n + 1) * t * n * h)
    bwd = Work("mhc", "", "bwd", 2 * streams + y + coefs + streams + y + coefs,
               fp32_flops=4 * n * (n + 1) * t * h)
    return fwd, bwd


def mhc_work() -> List[Work]:
    from depthmix.kernels.mhc import bench
    from depthmix.kernels.mhc.reference import coefficient_width

    out = []
    for x in bench.shapes(smoke=False):
        m = coefficient_width(bench.VARIANT, x.streams)
        label = f"T{x.t}-n{x.streams}-h{x.hidden}"
        out += [(f"sinkhorn T{x.t}-n{x.streams}-it{bench.ITERS}",
                 _sinkhorn(x.t, x.streams, bench.ITERS)),
                (f"read {label}", _mhc_read(x.t, x.streams, x.hidden, m, bench.ITERS)),
                (f"post_res {label}", _mhc_post_res(x.t, x.streams, x.hidden))]
    return _label(out)


def _label(cases: List[Tuple[str, Tuple[Work, Work]]]) -> List[Work]:
    return [Work(w.op, label, w.direction, w.bytes, w.tensor_flops, w.fp32_flops, w.precision)
            for label, pair in cases for w in pair]


def all_work() -> List[Work]:
    """Forward and backward of every full benchmark shape of the four ops."""
    return depth_mix_work() + moda_work() + attnres_work() + mhc_work()
