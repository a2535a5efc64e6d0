"""Benchmarks of ``attnres`` for ``tools/bench_kernels.py --ops attnres``.

One AttnRes read: a softmax over ``S`` sources ``[T, 1, h]`` per token, with one
pseudo-query and an RMSNorm on the keys. Candidates: ``ours`` (the fused Triton kernel,
sources read in place through a pointer table), ``torch`` (the reference, which stacks the
sources in fp32), ``compile`` (``torch.compile`` of it), and the public kernels when
importable (GPU only):

* ``fla``: fla-core's ``fla.ops.attnres.fused_attnres(query, residuals, rms_weight, ...)``,
  the same op with the arguments in another order (separate sources, a key-norm gain);
* ``flash-attn-res``: its phase-1 op, a softmax over a *stacked* ``[N, B, T, h]`` source
  buffer for a batch of pseudo-queries, with a gainless key RMSNorm. The wrapper folds our
  key gain into the query (``w . (g * y r) = r y . (w * g)``, exact) and stacks the sources,
  a copy that package's Block AttnRes avoids by keeping one preallocated buffer: its time
  here is an upper bound on what it would cost in our stack. Its output is bf16 only, and
  it holds a token's ``S`` sources in registers at once (made for Block AttnRes's few
  blocks), so ``full`` may be slow or refused.

Shapes: ``T = 4K, 16K, 64K`` tokens (batch 1), hidden 2048 (the 3B preset; 1.5B is 1536),
bf16 sources and parameters (``params_dtype`` under bf16 training), and a realistic number
of sources for the 48-layer presets (96 sublayers and the head, :func:`num_sources`):

* ``full``: Full AttnRes, ``S = 49``: the middle read (layer 24's attention), also the mean
  over the model's 97 reads;
* ``block``: Block AttnRes at the default ``block_size = 12``, ``S = 9``: the most any read
  holds (the head's embedding and 8 block sums; in the last block, the embedding, 7 block
  sums and the running partial sum).

The reference's fp32 stack is 26 GB for ``full`` at 64K: it may run out of memory there,
which the table reports. Without CUDA one smoke shape of each kind runs (fp32, ``ours``
only through the Triton interpreter, ``compile`` left out: Inductor's CPU build takes
minutes here and says nothing about GPUs).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from depthmix.bench.case import Case, implementations
from depthmix.bench.roofline import BF16, FP32, Work, label_pairs

HIDDEN, NUM_LAYERS, BLOCK_SIZE, EPS = 2048, 48, 12, 1e-6


class Shape(NamedTuple):
    kind: str  # full | block
    t: int
    hidden: int
    sources: int
    dtype: torch.dtype


def num_sources(block_size: int, num_layers: int = NUM_LAYERS) -> int:
    """Sources of the middle read (Full, ``block_size = 1``) or of the largest read (Block)."""
    from depthmix.mixers.attnres import AttnResGeometry

    geo = AttnResGeometry(2 * num_layers, block_size)
    if block_size == 1:
        return len(geo.sources(AttnResGeometry.sublayer(num_layers // 2, "attn")))
    return max(len(geo.sources(i)) for i in range(1, geo.head + 1))


def shapes(smoke: bool) -> list:
    if smoke:
        return [Shape("full", 64, 64, 5, torch.float32), Shape("block", 64, 64, 3, torch.float32)]
    full, block = num_sources(1), num_sources(BLOCK_SIZE)
    return [Shape(kind, t, HIDDEN, s, torch.bfloat16)
            for kind, s in (("full", full), ("block", block)) for t in (4096, 16384, 65536)]


def _inputs(shape: Shape, device: str):
    def make():
        sources = [torch.randn(shape.t, 1, shape.hidden, dtype=shape.dtype, device=device)
                   .requires_grad_() for _ in range(shape.sources)]
        query = torch.randn(shape.hidden, dtype=shape.dtype, device=device).requires_grad_()
        key_weight = (1 + 0.1 * torch.randn(shape.hidden, device=device)).to(shape.dtype)
        return (sources, query, key_weight.requires_grad_()), {}

    return make


def _read(op: Callable) -> Callable:
    """One read in our argument layout ``(sources, query, key_weight)``."""
    def run(sources, query, key_weight):
        return op(sources, query, key_weight, EPS)
    return run


def _fla_attnres() -> Optional[Callable]:
    try:
        from fla.ops.attnres import fused_attnres as fla_attnres
    except Exception:  # fla-core is optional and GPU-only
        return None

    def op(sources, query, key_weight, eps):
        return fla_attnres(query, sources, key_weight, rms_eps=eps)

    return op


def _flash_attn_res() -> Optional[Callable]:
    try:
        from flash_attn_res import phase_1_batched_attention_triton_op
    except Exception:  # flash-attn-res is optional and GPU-only
        return None

    def op(sources, query, key_weight, eps):
        shape = sources[0].shape  # [T, b, h] -> its [S, 1, T*b, h] buffer, one query
        stacked = torch.stack([y.reshape(1, -1, shape[-1]) for y in sources])
        out, _ = phase_1_batched_attention_triton_op(stacked, (query * key_weight)[None], eps)
        return out[0].reshape(shape)

    return op


def _label(shape: Shape) -> str:
    label = f"{shape.kind} T{shape.t}-S{shape.sources}-h{shape.hidden}"
    return label + ("-fp32" if shape.dtype == torch.float32 else "")


def cases(smoke: bool) -> list:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    ops = implementations("attnres", cuda)
    if cuda:
        for name, public in (("fla", _fla_attnres()), ("flash-attn-res", _flash_attn_res())):
            if public is not None:
                ops[name] = public

    return [Case("attnres", _label(shape), _inputs(shape, device),
                 {name: _read(op) for name, op in ops.items()})
            for shape in shapes(smoke or not cuda)]


# ---------------------------------------------------------------------------------------
# What the full shapes cost (depthmix.bench.roofline) and launch (depthmix.bench.gpu_report)
# ---------------------------------------------------------------------------------------


def work(t: int, d: int, s: int) -> tuple:
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


def roofline_work() -> list:
    """Forward and backward :class:`Work` of every full shape."""
    return label_pairs([(f"{x.kind} T{x.t}-S{x.sources}-h{x.hidden}",
                         work(x.t, x.hidden, x.sources)) for x in shapes(smoke=False)])


def gpu_launches() -> list:
    """Full and Block AttnRes reads, without and with the output norm (the sublayer's input
    RMSNorm, ``read_normed`` under ``impl=triton``)."""
    from depthmix.kernels.attnres import triton as K
    from depthmix.bench.gpu_report import expand, meta, recorded_launches

    out = []
    for kind, t, hidden, s, dtype in shapes(smoke=False):
        sources = [meta(t, 1, hidden, dtype=dtype) for _ in range(s)]
        query, key_weight = meta(hidden, dtype=dtype), meta(hidden, dtype=dtype)
        for norm in (None, meta(hidden, dtype=dtype)):
            with recorded_launches(K) as calls:
                o, z, rstd, lse = K.attnres_fwd(sources, query, key_weight, EPS, norm, EPS)
                K.attnres_bwd(sources, query, key_weight, norm, EPS, o, z, rstd, lse)
            out += expand("attnres", f"h{hidden}" + ("" if norm is None else " norm"), K, calls)
    return out
