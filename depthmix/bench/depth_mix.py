"""Benchmarks of ``depth_mix`` for ``tools/bench_kernels.py --ops depth_mix``.

Two kinds of case, all in the 3B-width head layout with head dim 128 (16 query heads,
``G = 1, 4, 8`` -> 16, 4, 2 KV heads), batch 1, bf16, ``T = 4K, 16K, 64K``, ``S = 2``
sources (Depth-Attention's default stride: the second half of the layers mixes over two):

* ``op``: the depth step alone — ``ours`` (the Triton kernel), ``torch`` (the reference),
  ``compile`` (``torch.compile`` of the reference). There is no public kernel to compare
  with: the paper's code is an einsum before SDPA, which is what ``torch`` does.
* ``attn+mix``: what issue 9 targets, "Depth-Attention's attention + mix <= 1.02x plain
  attention": causal attention on the mixed value vs causal attention alone (the
  ``baseline`` the ratio column divides by). Attention is the stack's ``causal_sdpa``
  (flash SDPA on GPU); when fla-core is importable, the same pair again with its
  ``parallel_attn`` as the plain attention.

Without CUDA one smoke shape runs (fp32, ``ours`` only through the Triton interpreter,
``compile`` left out: Inductor's CPU build takes minutes here and says nothing about GPUs).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from depthmix.bench.case import Case, fla_causal_attention, implementations
from depthmix.bench.roofline import BF16, FP32, Work, label_pairs
from depthmix.megatron_ext.attention import causal_sdpa


NUM_HEADS, HEAD_DIM, NUM_SOURCES = 16, 128, 2


class Shape(NamedTuple):
    t: int
    heads: int
    g: int
    head_dim: int
    dtype: torch.dtype
    sources: int = NUM_SOURCES


def shapes(smoke: bool) -> list:
    if smoke:
        return [Shape(64, 4, 2, 32, torch.float32)]
    return [Shape(t, NUM_HEADS, g, HEAD_DIM, torch.bfloat16)
            for t in (4096, 16384, 65536) for g in (1, 4, 8)]


def _inputs(t: int, heads: int, groups: int, head_dim: int, num_sources: int,
            dtype: torch.dtype, device: str):
    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()

    def make():
        query = leaf(t, 1, heads, head_dim)
        key, value = leaf(t, 1, heads // groups, head_dim), leaf(t, 1, heads // groups, head_dim)
        src_keys = [leaf(t, 1, heads // groups, head_dim) for _ in range(num_sources)]
        src_values = [leaf(t, 1, heads // groups, head_dim) for _ in range(num_sources)]
        return (query, key, value, src_keys, src_values), {}

    return make


def _mixed_value(mix: Callable) -> Callable:
    """The op in value mode (the default): only the mixed value is an output."""
    def run(query, key, value, src_keys, src_values):
        return mix(query, key, value, src_keys, src_values)[1]
    return run


def _then(mix: Callable, attention: Callable) -> Callable:
    """Depth step, then causal attention on the mixed value."""
    def run(query, key, value, src_keys, src_values):
        return attention(query, key, mix(query, key, value, src_keys, src_values)[1])
    return run


def _plain(attention: Callable) -> Callable:
    def run(query, key, value, src_keys, src_values):
        return attention(query, key, value)
    return run


def cases(smoke: bool) -> list:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    mixes = implementations("depth_mix", cuda)
    attentions = {"sdpa": causal_sdpa}
    fla = fla_causal_attention() if cuda else None
    if fla is not None:
        attentions["fla"] = fla

    out = []
    for t, heads, g, hd, dtype, num_sources in shapes(smoke or not cuda):
        label = f"T{t}-G{g}-hd{hd}" + (f"-np{heads}-fp32" if dtype == torch.float32 else "")
        make = _inputs(t, heads, g, hd, num_sources, dtype, device)
        out.append(Case("depth_mix", f"op {label}", make,
                        {name: _mixed_value(mix) for name, mix in mixes.items()}))
        for attn_name, attention in attentions.items():
            candidates = {attn_name: _plain(attention)}
            candidates.update({f"{name}+{attn_name}": _then(mix, attention)
                               for name, mix in mixes.items()})
            out.append(Case("depth_mix", f"attn+mix {label}", make, candidates,
                            baseline=attn_name))
    return out


# ---------------------------------------------------------------------------------------
# What the full shapes cost (depthmix.bench.roofline) and launch (depthmix.bench.gpu_report)
# ---------------------------------------------------------------------------------------


def work(t: int, heads: int, g: int, d: int, s: int) -> tuple:
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


def roofline_work() -> list:
    """Forward and backward :class:`Work` of every full shape (``mix_rule=softmax``,
    ``mixed_state=value``)."""
    return label_pairs([(f"T{x.t}-G{x.g}-hd{x.head_dim}",
                         work(x.t, x.heads, x.g, x.head_dim, x.sources))
                        for x in shapes(smoke=False)])


def gpu_launches(mixed_states: Sequence[str] = ("key_value", "value")) -> list:
    """``mix_rule=softmax`` (the default; ``uniform`` has no score path), the benchmark's
    ``mixed_state=value`` and ``key_value``, which keeps the most tiles live. Heaviest
    first (both states, then the largest group), so that a config's first variant is the
    one most likely to spill."""
    from depthmix.kernels.depth_mix import triton as K
    from depthmix.bench.gpu_report import expand, meta, recorded_launches

    out = []
    for t, heads, g, hd, dtype, s in sorted(shapes(smoke=False), key=lambda s: -s.g):
        ng = heads // g
        q = meta(t, 1, heads, hd, dtype=dtype)
        k, v = meta(t, 1, ng, hd, dtype=dtype), meta(t, 1, ng, hd, dtype=dtype)
        src_k = [meta(t, 1, ng, hd, dtype=dtype) for _ in range(s)]
        src_v = [meta(t, 1, ng, hd, dtype=dtype) for _ in range(s)]
        for state in mixed_states:
            flags = dict(softmax=True, mix_keys=state in ("key", "key_value"),
                         mix_values=state in ("value", "key_value"), scale=hd ** -0.5)
            with recorded_launches(K) as calls:
                k_out, v_out, lse = K.depth_mix_fwd(q, k, v, src_k, src_v, **flags)
                K.depth_mix_bwd(q, k, v, src_k, src_v, lse, k_out, v_out, **flags)
            out += expand("depth_mix", f"G{g} hd{hd} S{s} {state}", K, calls)
    return out
