"""Benchmarks of the mHC ops for ``tools/bench_kernels.py --ops mhc``.

Three kinds of case, each ``ours`` (the Triton kernel), ``torch`` (the reference) and
``compile`` (``torch.compile`` of it); there is no public fused kernel of these ops to
compare with:

* ``sinkhorn``: the Sinkhorn-Knopp projection alone, ``[T, 1, n, n]`` fp32 logits, the
  default 20 iterations. Issue 9's target is ``ours`` at least 5x faster than ``compile``,
  so on GPU ``compile`` is the ``baseline`` the ratio column divides by (target <= 0.2).
* ``read``: launch 1 of a sublayer, ``mhc_read_reference`` (RMSNorm of the flattened streams,
  coefficient projection, gates, Sinkhorn, ``H_pre X``). Like the stack's
  ``HyperConnection.read``, it returns what the sublayer uses: ``x_in``, ``H_post``,
  ``H_res`` (``H_pre`` only feeds statistics).
* ``post_res``: launch 2, ``H_res X + H_post^T y`` cast to the streams' dtype, as
  ``HyperConnection.write`` does.

Shapes: what the stack hands these ops under the default ``mixer=mhc`` options
(``configs/mixer/mhc.yaml``: ``variant=mhc``, ``streams=4``, ``sinkhorn_iters=20``) at the
3B width: streams ``[T, 1, 4, 2048]`` and sublayer output ``[T, 1, 2048]`` in bf16, the
parameters ``phi [4 * 2048, 24]``, gates and biases in bf16 (``params_dtype`` under bf16
training), the coefficients fp32; batch 1, ``T = 4K, 16K, 64K``.

Without CUDA one smoke shape runs (fp32, hidden 64, ``ours`` only through the Triton
interpreter, ``compile`` left out: Inductor's CPU build takes minutes here and says nothing
about GPUs).
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple

import torch

from depthmix.bench.case import Case
from depthmix.kernels.dispatch import triton_status
from depthmix.bench.roofline import BF16, FP32, Work, label_pairs
from depthmix.kernels.mhc.reference import (
    mhc_post_res_reference,
    mhc_read_reference,
    sinkhorn_reference,
)
from depthmix.mixers.mhc import coefficient_width

STREAMS, HIDDEN, ITERS, EPS, VARIANT = 4, 2048, 20, 1e-6, "mhc"


class Shape(NamedTuple):
    t: int
    streams: int
    hidden: int
    dtype: torch.dtype
    """Of the streams, the sublayer output and the parameters; coefficients are fp32."""


def shapes(smoke: bool) -> list:
    if smoke:
        return [Shape(64, STREAMS, 64, torch.float32)]
    return [Shape(t, STREAMS, HIDDEN, torch.bfloat16) for t in (4096, 16384, 65536)]


def _leaf(*dims, dtype, device, scale: float = 1.0):
    return (scale * torch.randn(*dims, device=device)).to(dtype).requires_grad_()


def _sinkhorn_inputs(shape: Shape, device: str):
    def make():
        n = shape.streams
        return (_leaf(shape.t, 1, n, n, dtype=torch.float32, device=device), ITERS), {}
    return make


def _read_inputs(shape: Shape, device: str):
    def make():
        t, n, h, dtype = shape
        m = coefficient_width(VARIANT, n)
        x = _leaf(t, 1, n, h, dtype=dtype, device=device)
        phi = _leaf(n * h, m, dtype=dtype, device=device, scale=0.02)
        alpha = _leaf(3, dtype=dtype, device=device, scale=0.1)
        bias = _leaf(m, dtype=dtype, device=device)
        return (x, phi, alpha, bias), {}
    return make


def _post_res_inputs(shape: Shape, device: str):
    def make():
        t, n, h, dtype = shape
        x = _leaf(t, 1, n, h, dtype=dtype, device=device)
        y = _leaf(t, 1, h, dtype=dtype, device=device)
        h_post = _leaf(t, 1, n, dtype=torch.float32, device=device)
        h_res = _leaf(t, 1, n, n, dtype=torch.float32, device=device)
        return (x, y, h_post, h_res), {}
    return make


def _read(op: Callable) -> Callable:
    def run(x, phi, alpha, bias):
        x_in, _, h_post, h_res = op(x, phi, alpha, bias, VARIANT, ITERS, EPS)
        return x_in, h_post, h_res
    return run


def _post_res(op: Callable) -> Callable:
    def run(x, y, h_post, h_res):
        return op(x, y, h_post, h_res).to(x.dtype)
    return run


def _label(shape: Shape) -> str:
    label = f"T{shape.t}-n{shape.streams}-h{shape.hidden}"
    return label + ("-fp32" if shape.dtype == torch.float32 else "")


def cases(smoke: bool) -> list:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    ops: Dict[str, Dict[str, Callable]] = {
        "sinkhorn": {"torch": sinkhorn_reference},
        "read": {"torch": mhc_read_reference},
        "post_res": {"torch": mhc_post_res_reference},
    }
    if triton_status()[0]:
        from depthmix.kernels.mhc import function as fused

        for kind, op in (("sinkhorn", fused.sinkhorn_triton), ("read", fused.mhc_read_triton),
                         ("post_res", fused.mhc_post_res_triton)):
            ops[kind] = {"ours": op, **ops[kind]}
    if cuda:
        for kind in ops:
            ops[kind]["compile"] = torch.compile(ops[kind]["torch"], dynamic=False)

    out = []
    for shape in shapes(smoke or not cuda):
        label = _label(shape)
        out.append(Case("mhc", f"sinkhorn T{shape.t}-n{shape.streams}-it{ITERS}",
                        _sinkhorn_inputs(shape, device),
                        dict(ops["sinkhorn"]), baseline="compile" if cuda else "torch"))
        out.append(Case("mhc", f"read {label}", _read_inputs(shape, device),
                        {name: _read(op) for name, op in ops["read"].items()}))
        out.append(Case("mhc", f"post_res {label}", _post_res_inputs(shape, device),
                        {name: _post_res(op) for name, op in ops["post_res"].items()}))
    return out


# ---------------------------------------------------------------------------------------
# What the full shapes cost (depthmix.bench.roofline) and launch (depthmix.bench.gpu_report)
# ---------------------------------------------------------------------------------------


def _sinkhorn_flops(n: int, iters: int) -> tuple:
    """Per matrix: forward (row max, ``exp``: ``3 n^2``; each iteration two sums and two
    divisions, ``4 n^2``) and backward through stored iterates (one forward to get them,
    ``8 n^2`` per iteration, the final ``* e0``). Our kernel stores nothing and recomputes
    ``K (K - 1) / 2`` iterations instead (190 for ``K = 20``), about 4x this backward."""
    fwd = 3 * n * n + 4 * iters * n * n
    return fwd, fwd + 8 * iters * n * n + n * n


def _sinkhorn(t: int, n: int, iters: int) -> tuple:
    """fp32 logits ``[T, n, n]`` -> fp32 ``[T, n, n]``; backward logits and gradient in,
    gradient out."""
    fwd_flops, bwd_flops = _sinkhorn_flops(n, iters)
    mat = FP32 * t * n * n
    return (Work("mhc", "", "fwd", 2 * mat, fp32_flops=t * fwd_flops),
            Work("mhc", "", "bwd", 3 * mat, fp32_flops=t * bwd_flops))


def read_work(t: int, n: int, h: int, m: int, iters: int) -> tuple:
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


def post_res_work(t: int, n: int, h: int) -> tuple:
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


def roofline_work() -> list:
    """Forward and backward :class:`Work` of every full shape: Sinkhorn alone, the read
    (launch 1) and post/res (launch 2)."""
    out = []
    for x in shapes(smoke=False):
        m = coefficient_width(VARIANT, x.streams)
        label = f"T{x.t}-n{x.streams}-h{x.hidden}"
        out += [(f"sinkhorn T{x.t}-n{x.streams}-it{ITERS}",
                 _sinkhorn(x.t, x.streams, ITERS)),
                (f"read {label}", read_work(x.t, x.streams, x.hidden, m, ITERS)),
                (f"post_res {label}", post_res_work(x.t, x.streams, x.hidden))]
    return label_pairs(out)


def gpu_launches() -> list:
    """Sinkhorn alone (fp32 logits), the read and the post/res launches (bf16 streams);
    every output gradient present, as autograd materialises them."""
    from depthmix.kernels.mhc import triton as K
    from depthmix.bench.gpu_report import expand, meta, recorded_launches

    out = []
    for t, n, h, dtype in shapes(smoke=False):
        m = coefficient_width(VARIANT, n)
        logits = meta(t, n, n, dtype=torch.float32)
        x, y = meta(t, n, h, dtype=dtype), meta(t, h, dtype=dtype)
        phi, alpha, bias = (meta(n * h, m, dtype=dtype), meta(3, dtype=dtype),
                            meta(m, dtype=dtype))
        with recorded_launches(K) as calls:
            K.sinkhorn_bwd(logits, K.sinkhorn_fwd(logits, ITERS), ITERS)
            x_in, h_pre, h_post, h_res, dyn, rstd = K.mhc_read_fwd(
                x, phi, alpha, bias, VARIANT, ITERS, EPS)
            K.mhc_read_bwd(x, phi, alpha, bias, h_pre, dyn, rstd, x_in, h_pre, h_post, h_res,
                           VARIANT, ITERS)
            K.mhc_post_res_fwd(x, y, h_post, h_res)
            K.mhc_post_res_bwd(x, y, h_post, h_res, x)
        out += expand("mhc", f"{VARIANT} n{n} h{h}", K, calls)
        # the read with the sublayer's input RMSNorm (read_normed under impl=triton)
        norm = meta(h, dtype=dtype)
        with recorded_launches(K) as calls:
            x_in, h_pre, h_post, h_res, dyn, rstd = K.mhc_read_fwd(
                x, phi, alpha, bias, VARIANT, ITERS, EPS, norm, EPS)
            K.mhc_read_bwd(x, phi, alpha, bias, h_pre, dyn, rstd, x_in, h_pre, h_post, h_res,
                           VARIANT, ITERS, norm, EPS)
        out += expand("mhc", f"{VARIANT} n{n} h{h} norm", K, calls)
    return out
