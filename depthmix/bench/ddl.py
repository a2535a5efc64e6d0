"""Benchmarks of DDL's ops for ``tools/bench_kernels.py --ops ddl``.

Two kinds of case, each ``ours`` (the Triton kernel), ``torch`` (the reference) and
``compile`` (``torch.compile`` of it); there is no public fused kernel of these ops:

* ``read``: ``x_in = X r``;
* ``write``: the delta update ``X + beta k (v^T - k^T X)`` with its key normalisation,
  gate and values, as ``DeltaResidual.write`` calls it.

Shapes: the default ``mixer=ddl`` (``value_channels=4``) at the 1.5B width (hidden 1536):
state ``[T, 1, 1536, 4]``, rows ``[T, 1, 1536]`` and parameters in bf16 (``params_dtype``
under bf16 training); batch 1, ``T = 4K, 16K, 64K``.

Without CUDA one smoke shape runs (fp32, hidden 64, ``ours`` only through the Triton
interpreter, ``compile`` left out).
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple

import torch

from depthmix.config.schema import ModelConfig
from depthmix.bench.case import Case
from depthmix.kernels.ddl.reference import ddl_read_reference, ddl_write_reference
from depthmix.kernels.dispatch import triton_status
from depthmix.bench.roofline import BF16, FP32, Work, label_pairs
from depthmix.mixers.ddl import DDLConfig

HIDDEN, EPS = 1536, ModelConfig().norm_epsilon
VALUE_CHANNELS, V_SCALE = DDLConfig().value_channels, DDLConfig().v_scale


class Shape(NamedTuple):
    t: int
    hidden: int
    dv: int
    dtype: torch.dtype


def shapes(smoke: bool) -> list:
    if smoke:
        return [Shape(64, 64, VALUE_CHANNELS, torch.float32)]
    return [Shape(t, HIDDEN, VALUE_CHANNELS, torch.bfloat16) for t in (4096, 16384, 65536)]


def _leaf(*dims, dtype, device, scale: float = 1.0):
    return (scale * torch.randn(*dims, device=device)).to(dtype).requires_grad_()


def _read_inputs(shape: Shape, device: str):
    def make():
        t, h, dv, dtype = shape
        return (_leaf(t, 1, h, dv, dtype=dtype, device=device),
                _leaf(dv, dtype=dtype, device=device)), {}
    return make


def _write_inputs(shape: Shape, device: str):
    def make():
        t, h, dv, dtype = shape

        def leaf(*dims, scale=1.0):
            return _leaf(*dims, dtype=dtype, device=device, scale=scale)

        return (leaf(t, 1, h, dv), leaf(t, 1, h), leaf(t, 1, h), leaf(h, scale=0.02), leaf(1),
                leaf(dv, h, scale=0.02), leaf(dv)), {}
    return make


def _write(op: Callable) -> Callable:
    def run(x, y, x_in, beta_weight, beta_bias, v_weight, v_bias):
        return op(x, y, x_in, beta_weight, beta_bias, v_weight, v_bias, V_SCALE, EPS,
                  return_beta=False)[0]
    return run


def cases(smoke: bool) -> list:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    ops: Dict[str, Dict[str, Callable]] = {"read": {"torch": ddl_read_reference},
                                           "write": {"torch": ddl_write_reference}}
    if triton_status()[0]:
        from depthmix.kernels.ddl import function as fused

        ops["read"] = {"ours": fused.ddl_read_triton, **ops["read"]}
        ops["write"] = {"ours": fused.ddl_write_triton, **ops["write"]}
    if cuda:
        for kind in ops:
            ops[kind]["compile"] = torch.compile(ops[kind]["torch"], dynamic=False)

    out = []
    for shape in shapes(smoke or not cuda):
        label = f"T{shape.t}-h{shape.hidden}-dv{shape.dv}" + (
            "-fp32" if shape.dtype == torch.float32 else "")
        out.append(Case("ddl", f"read {label}", _read_inputs(shape, device), dict(ops["read"])))
        out.append(Case("ddl", f"write {label}", _write_inputs(shape, device),
                        {name: _write(op) for name, op in ops["write"].items()}))
    return out


# ---------------------------------------------------------------------------------------
# What the full shapes cost (depthmix.bench.roofline) and launch (depthmix.bench.gpu_report)
# ---------------------------------------------------------------------------------------


def read_work(t: int, h: int, dv: int) -> tuple:
    """``X r``: reads ``X``, writes ``x_in`` (``2 h d_v`` FLOPs a token); backward reads
    ``X`` and ``dx_in``, writes ``dX`` (``dX = dx_in r^T``, ``dr = sum X dx_in``:
    ``3 h d_v``)."""
    state, row = BF16 * t * h * dv, BF16 * t * h
    return (Work("ddl", "", "fwd", state + row, fp32_flops=2 * t * h * dv),
            Work("ddl", "", "bwd", 2 * state + row, fp32_flops=3 * t * h * dv))


def write_work(t: int, h: int, dv: int) -> tuple:
    """The delta update. Forward per token: ``||y||^2``, ``||x_in||^2``, ``w . x_in``
    (``2 h`` each), ``W_v x_in`` and ``y^T X`` (``2 h d_v`` each), ``X + k delta^T``
    (``3 h d_v``); bytes ``X``, ``y``, ``x_in``, the parameters -> ``X'`` and ``6 + 3 d_v``
    fp32 statistics (``2 + d_v`` of them the backward's room, zeroed). Backward: ``k^T G``
    (``2 h d_v``), ``dX`` (``2 h d_v``), ``dk`` (``4 h d_v``), ``dy`` (``3 h``), ``dx_in``
    (``2 h d_v + 5 h``), the parameter
    reductions (``2 h d_v + 2 h``); bytes ``X``, ``y``, ``x_in``, the statistics and
    ``dL/dX'`` -> ``dX``, ``dy``, ``dx_in`` and the parameter gradients, and the ``2 + d_v``
    per-token intermediates written and read back."""
    state, row = BF16 * t * h * dv, BF16 * t * h
    params = BF16 * ((dv + 1) * h + dv + 1)
    stats, inter = FP32 * t * (4 + 2 * dv), FP32 * t * (2 + dv)
    fwd = Work("ddl", "", "fwd", 2 * state + 2 * row + params + stats + inter,
               fp32_flops=t * (7 * h * dv + 6 * h))
    bwd = Work("ddl", "", "bwd", 3 * state + 4 * row + 2 * params + stats + 2 * inter,
               fp32_flops=t * (12 * h * dv + 10 * h))
    return fwd, bwd


def roofline_work() -> list:
    """Forward and backward :class:`Work` of every full shape: the read and the update."""
    out = []
    for x in shapes(smoke=False):
        label = f"T{x.t}-h{x.hidden}-dv{x.dv}"
        out += [(f"read {label}", read_work(x.t, x.hidden, x.dv)),
                (f"write {label}", write_work(x.t, x.hidden, x.dv))]
    return label_pairs(out)


def gpu_launches() -> list:
    """The read and the update, forward and backward (bf16 state, rows and parameters)."""
    from depthmix.kernels.ddl import triton as K
    from depthmix.bench.gpu_report import expand, meta, recorded_launches

    out = []
    for t, h, dv, dtype in shapes(smoke=False):
        x, y = meta(t, 1, h, dv, dtype=dtype), meta(t, 1, h, dtype=dtype)
        read, wb, bb = meta(dv, dtype=dtype), meta(h, dtype=dtype), meta(1, dtype=dtype)
        wv, bv = meta(dv, h, dtype=dtype), meta(dv, dtype=dtype)
        with recorded_launches(K) as calls:
            x_in = K.ddl_read_fwd(x, read)
            K.ddl_read_bwd(x, read, x_in)
            new, stats = K.ddl_write_fwd(x, y, x_in, wb, bb, wv, bv, V_SCALE, EPS)
            K.ddl_write_bwd(x, y, x_in, wb, wv, stats, V_SCALE, new)
        out += expand("ddl", f"h{h} dv{dv}", K, calls)
    return out
