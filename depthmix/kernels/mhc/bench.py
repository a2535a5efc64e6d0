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

from depthmix.kernels.bench_case import Case
from depthmix.kernels.dispatch import triton_status
from depthmix.kernels.mhc.reference import (
    coefficient_width,
    mhc_post_res_reference,
    mhc_read_reference,
    sinkhorn_reference,
)

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
