"""Benchmarks of ``moda_attention`` for ``tools/bench_kernels.py --ops moda_attention``.

What issue 9 asks of the MoDA kernel is its price over plain attention: MoDA's
forward+backward time over plain causal attention at each ``T`` (MoDA paper's targets, A100
vs FlashAttention-2 in Triton: +25.9% at 4K, +8.6% at 16K, +2.7% at 64K). So every case
holds the plain attention as its ``baseline`` and the ratio column is that overhead
(targets: ``ours`` <= 1.259, 1.086, 1.027):

* ``moda``: ``sdpa`` (the stack's ``causal_sdpa``, flash SDPA on GPU: what a layer without
  depth entries runs) against ``ours`` (the default Triton path, ``mixer.moda_kernel=split``:
  SDPA's cuDNN / flash attention for the sequence part and a Triton depth kernel, merged
  by log-sum-exp), ``fused`` (the fused Triton kernel, ``mixer.moda_kernel=fused``),
  ``torch`` (the reference) and ``compile`` (``torch.compile`` of the reference). The
  reference materialises the fp32 scores ``[b, np, T, T + D]`` (16 GiB at 16K, 256 GiB at
  64K), so ``torch`` and ``compile`` only run up to ``REFERENCE_MAX_T``.
* ``moda/fla``: when fla-core is importable (GPU only), its ``parallel_attn`` (a
  flash-attention kernel in Triton, the closest to the paper's FA2-Triton) as the plain
  attention, against ``ours`` and ``fused``.

Each label ends with the split path's **depth floor** on an H100 and an H200
(:func:`depth_floor`): the least time the depth part can take as the separate,
memory-bound pass it is. The split path's target (issue 37): ``ours`` forward+backward
``<= sdpa + 1.3 x`` that floor (the run's own device's).

Shapes: the head layout of the ``depth_mix`` benchmark, the 3B width (2048) as 16 query
heads of dim 128, ``G = 1, 4, 8`` (16, 4, 2 KV heads), batch 1, bf16, ``T = 4K, 16K, 64K``.
The depth KV ``[T, 1, ng, D, 128]`` holds what a layer reads with the mixer's default
options (``configs/mixer/moda.yaml``: ``ffn_kv_proj`` on, ``depth_window`` null, i.e.
every earlier attention and MLP entry) in the middle layer (24) of the 48-layer 1.5B/3B
presets: ``D = 48`` (:func:`depth_entries`), the per-layer mean (47) rounded to a whole
layer; the last layer reads 94. (The presets' own heads are 64 wide.) The depth tensors are
contiguous leaves, as the mixer's ``torch.stack`` of its entries makes them (the stack's
copy is not timed).

* ``moda/paper``: the rows of the MoDA paper's kernel table (A100, bf16, forward+backward,
  ``B = 1``, ``d = 64``, chunk 64): ``T`` 4K-64K at ``G = 8``, the ``G`` sweep 2-32 at 16K and
  the depth sweep ``L = 64, 128, 256`` at 16K, ``H_k = 8`` KV heads throughout. Its ``L`` is
  the depth entries a row reads. Each label carries the paper's own MoDA/FA2-Triton ratio
  (``paper x1.259``) so a GPU run sets ours beside it row by row; no reference candidates
  (the materialised scores would not fit).

Without CUDA one smoke shape runs (fp32, ``ours`` and ``fused`` through the Triton
interpreter, ``ours`` on the CPU flash kernel; ``compile`` left out: Inductor's CPU build
takes minutes here and says nothing about GPUs).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from depthmix.bench.case import Case, fla_causal_attention, implementations
from depthmix.bench.roofline import BF16, FP32, Work, label_pairs
from depthmix.megatron_ext.attention import causal_sdpa
from depthmix.planning.hardware import H100, H200, Device

NUM_HEADS, HEAD_DIM, NUM_LAYERS = 16, 128, 48
REFERENCE_MAX_T = 16384
"""Longest sequence the reference (and its compiled form) is timed at."""


class Shape(NamedTuple):
    t: int
    heads: int
    g: int
    head_dim: int
    depth: int
    dtype: torch.dtype


def depth_entries(num_layers: int = NUM_LAYERS) -> int:
    """Depth entries the middle layer reads under the default ``mixer=moda`` options."""
    from depthmix.mixers.moda import MoDAGeometry

    geo = MoDAGeometry(num_layers, 1, ffn_kv_proj=True, depth_window=None)
    return len(geo.visible(num_layers // 2))


# MoDA paper, kernel efficiency table: (row, T, G, H_q, H_k, L, FA2-Triton ms, MoDA-Triton ms)
PAPER_ROWS = (
    (1, 4096, 8, 64, 8, 64, 7.970, 10.750),
    (2, 8192, 8, 64, 8, 64, 28.700, 35.427),
    (3, 16384, 8, 64, 8, 64, 116.700, 127.661),
    (4, 32768, 8, 64, 8, 64, 459.854, 480.914),
    (5, 65536, 8, 64, 8, 64, 1831.668, 1883.026),
    (6, 16384, 2, 16, 8, 64, 28.982, 39.741),
    (7, 16384, 4, 32, 8, 64, 58.071, 68.939),
    (9, 16384, 16, 128, 8, 64, 233.700, 244.900),
    (10, 16384, 32, 256, 8, 64, 467.107, 480.767),
    (12, 16384, 8, 64, 8, 128, 116.700, 138.224),
    (13, 16384, 8, 64, 8, 256, 116.700, 167.958),
)
"""Rows 8 and 11 repeat row 3 in the paper and are left out."""
PAPER_HEAD_DIM = 64


def paper_shapes() -> list:
    return [Shape(t, hq, g, PAPER_HEAD_DIM, depth, torch.bfloat16)
            for _, t, g, hq, _, depth, _, _ in PAPER_ROWS]


def shapes(smoke: bool) -> list:
    if smoke:
        return [Shape(64, 4, 2, 32, 4, torch.float32)]
    d = depth_entries()
    return [Shape(t, NUM_HEADS, g, HEAD_DIM, d, torch.bfloat16)
            for t in (4096, 16384, 65536) for g in (1, 4, 8)]


def _inputs(shape: Shape, device: str):
    t, heads, g, hd, d, dtype = shape

    def leaf(*dims):
        return torch.randn(*dims, dtype=dtype, device=device).requires_grad_()

    def make():
        query = leaf(t, 1, heads, hd)
        key, value = leaf(t, 1, heads // g, hd), leaf(t, 1, heads // g, hd)
        depth_key, depth_value = leaf(t, 1, heads // g, d, hd), leaf(t, 1, heads // g, d, hd)
        return (query, key, value, depth_key, depth_value), {}

    return make


def _plain(attention: Callable) -> Callable:
    """Causal attention over the sequence only (the depth KV is ignored)."""
    def run(query, key, value, depth_key, depth_value):
        return attention(query, key, value)
    return run


def _label(shape: Shape) -> str:
    label = f"T{shape.t}-G{shape.g}-hd{shape.head_dim}-D{shape.depth}"
    return label + (f"-np{shape.heads}-fp32" if shape.dtype == torch.float32 else "")


def _floors(shape: Shape) -> str:
    h100, h200 = (depth_floor(shape, device) * 1e3 for device in (H100, H200))
    return f"(depth floor H100 {h100:.3f} / H200 {h200:.3f} ms)"


def cases(smoke: bool) -> list:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    references = implementations("moda_attention", cuda)  # torch, compile
    ours = {"ours": references.pop("ours")} if "ours" in references else {}
    if ours:
        from depthmix.kernels.moda_attention import moda_attention_fused

        ours["fused"] = moda_attention_fused
    fla = fla_causal_attention() if cuda else None

    out = []
    for shape in shapes(smoke or not cuda):
        label, make = f"{_label(shape)} {_floors(shape)}", _inputs(shape, device)
        candidates = {"sdpa": _plain(causal_sdpa), **ours}
        if shape.t <= REFERENCE_MAX_T:
            candidates.update(references)
        out.append(Case("moda_attention", f"moda {label}", make, candidates, baseline="sdpa"))
        if fla is not None:
            out.append(Case("moda_attention", f"moda/fla {label}", make,
                            {"fla": _plain(fla), **ours}, baseline="fla"))
    if not (smoke or not cuda):
        for row, shape in zip(PAPER_ROWS, paper_shapes()):
            paper = row[7] / row[6]
            plain = {"fla": _plain(fla)} if fla is not None else {"sdpa": _plain(causal_sdpa)}
            out.append(Case("moda_attention",
                            f"moda/paper row {row[0]} {_label(shape)} (paper x{paper:.3f}) "
                            f"{_floors(shape)}",
                            _inputs(shape, device), {**plain, **ours},
                            baseline=next(iter(plain))))
    return out


# ---------------------------------------------------------------------------------------
# What the full shapes cost (depthmix.bench.roofline) and launch (depthmix.bench.gpu_report)
# ---------------------------------------------------------------------------------------


def work(t: int, heads: int, g: int, d: int, depth: int) -> tuple:
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


def depth_work(t: int, heads: int, g: int, d: int, depth: int) -> tuple:
    """What ``depth`` entries add to the plain causal attention vanilla runs: :func:`work`
    with them less :func:`work` without (a MoDA layer's share of the step floor)."""
    return tuple(Work(a.op, a.case, a.direction, a.bytes - b.bytes,
                      a.tensor_flops - b.tensor_flops, a.fp32_flops - b.fp32_flops, a.precision)
                 for a, b in zip(work(t, heads, g, d, depth), work(t, heads, g, d, 0)))


def depth_bytes(t: int, heads: int, g: int, d: int, depth: int, elem: int = BF16) -> tuple:
    """``(forward, backward)`` bytes the split path's depth part must move (batch 1): each
    tensor its kernels touch once, at its dtype (``elem`` bytes; fp32 log-sum-exps)::

        forward   q, depth k/v, the sequence output o_S, lse_S -> joint o, lse
                  elem T (3 H d + 2 H_kv D d) + 8 T H
        backward  q, depth k/v, o, dO, dQ_S, lse -> dQ, depth dK/dV
                  elem T (5 H d + 4 H_kv D d) + 4 T H

    (``H`` query heads, ``H_kv = H / G``, head dim ``d``, ``D`` depth entries.) The depth
    k/v terms dominate (``6 elem T H_kv D d`` of it); the rest is what a separate pass
    re-reads of the attention's own tensors. Its FLOPs, ``4 H D d`` a token forward and
    ``8 H D d`` backward (``G`` per loaded depth element), are far below any peak."""
    ng = heads // g
    per_row, depth_kv = heads * d, ng * depth * d
    fwd = elem * t * (3 * per_row + 2 * depth_kv) + 2 * FP32 * t * heads
    bwd = elem * t * (5 * per_row + 4 * depth_kv) + FP32 * t * heads
    return fwd, bwd


def depth_floor(shape: Shape, device: Device = H100) -> float:
    """Seconds the split path's depth part takes at least, forward + backward: its bytes
    (:func:`depth_bytes`) at ``device``'s HBM bandwidth."""
    elem = torch.finfo(shape.dtype).bits // 8
    fwd, bwd = depth_bytes(shape.t, shape.heads, shape.g, shape.head_dim, shape.depth, elem)
    return (fwd + bwd) / (device.hbm_tb_s * 1e12)


def roofline_work() -> list:
    """Forward and backward :class:`Work` of every full shape and paper row."""
    full = [(f"T{x.t}-G{x.g}-hd{x.head_dim}-D{x.depth}", x) for x in shapes(False)]
    full += [(f"paper row {row[0]}: T{x.t}-G{x.g}-hd{x.head_dim}-D{x.depth}-np{x.heads}", x)
             for row, x in zip(PAPER_ROWS, paper_shapes())]
    return label_pairs([(label, work(x.t, x.heads, x.g, x.head_dim, x.depth))
                        for label, x in full])


def gpu_launches() -> list:
    """The 3B-layout shapes and the MoDA paper's rows: the fused kernels (tiles from
    ``default_tiles``) and the split path's depth kernels (``default_depth_tiles``)."""
    from depthmix.kernels.moda_attention import triton as K
    from depthmix.bench.gpu_report import expand, meta, recorded_launches

    out = []
    for t, heads, g, hd, d, dtype in shapes(smoke=False) + paper_shapes():
        ng = heads // g
        q = meta(t, 1, heads, hd, dtype=dtype)
        k, v = meta(t, 1, ng, hd, dtype=dtype), meta(t, 1, ng, hd, dtype=dtype)
        kd, vd = meta(t, 1, ng, d, hd, dtype=dtype), meta(t, 1, ng, d, hd, dtype=dtype)
        tiles = K.default_tiles(hd, g, d)
        depth_tiles = K.default_depth_tiles(hd, g, d)
        # the split path's sequence part as flash attention returns it: o over [b, s, h, d]
        o_seq = meta(1, t, heads, hd, dtype=dtype).transpose(1, 2)
        lse_seq = meta(1, heads, t, dtype=torch.float32)
        with recorded_launches(K) as calls:
            o, lse = K.moda_attention_fwd(q, k, v, kd, vd, d, hd ** -0.5, tiles)
            K.moda_attention_bwd(o, q, k, v, kd, vd, o, lse, d, hd ** -0.5, tiles)
            o, lse = K.moda_depth_fwd(q, kd, vd, o_seq, lse_seq, d, hd ** -0.5, depth_tiles)
            K.moda_depth_bwd(o, q, kd, vd, o, lse, o_seq, d, hd ** -0.5, depth_tiles)
        out += expand("moda_attention", f"G{g} hd{hd} D{d}", K, calls)
    return out
