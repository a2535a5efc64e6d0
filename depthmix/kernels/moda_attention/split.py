"""``moda_attention`` split: the sequence part through the machine's flash attention, the depth
part through one small Triton kernel, merged exactly.

The joint softmax of a query row over its causal sequence keys ``S`` and its own depth
entries ``D`` is two blocks of one softmax, merged as ring (context-parallel) attention
merges the blocks of a sequence::

    o_S, lse_S = attention over S             (an SDPA op that returns its log-sum-exp)
    lse        = logaddexp(lse_S, lse_D)
    o          = o_S e^(lse_S - lse) + sum_j e^(s_j - lse) V_j      (j in D)

The depth kernel (``triton.py``: ``_moda_depth_fwd_kernel``) starts its online softmax from
``(max = lse_S, sum = 1, acc = o_S)`` and runs it over the row's depth entries, so the merge
costs no pass of its own. Backward, with the *joint* ``o`` and ``lse``:

* the attention op's own backward, given ``o`` and ``lse`` in place of its ``o_S`` and
  ``lse_S``, computes ``P = exp(S - lse)`` and ``dS = P (dP - rowsum(dO o))`` over the
  sequence keys: exactly the joint softmax's gradient for ``dK``, ``dV`` and the sequence
  part of ``dQ`` (the standard trick of ring attention's backward);
* the depth kernel's backward (``_moda_depth_bwd_kernel``) does the same over the depth
  entries with the same ``lse`` and ``delta = rowsum(dO o)``: ``dK_dep``, ``dV_dep``, and
  ``dQ`` = the sequence part's plus the depth part's, in the same pass.

Nothing is approximated: this is the joint softmax, on the fastest attention kernel SDPA
has here (its own choice, ``torch._fused_sdp_choice``): cuDNN's or flash attention on CUDA
(``aten._scaled_dot_product_cudnn_attention`` / ``_flash_attention`` and their backwards),
the fused CPU flash kernel elsewhere (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward: the tests run the whole split path through it). All of them take the ``ng`` KV
heads of a GQA layer as they are (no repeat). The depth part is memory-bound: it reads each
depth entry once forward (once more and writes its gradient backward) and ``q``, ``o_S``,
``o``, ``dO``, ``dQ`` once.

Where that attention op cannot run the layer's shape the fused kernel
(:func:`~depthmix.kernels.moda_attention.function.moda_attention_fused`) does, logged once
per reason: decoding (``sq < sk``; flash attention's causal mask is not bottom-right
there) and CUDA inputs SDPA sends to neither cuDNN nor flash attention (fp32, head dims it
does not take).

Host cost: eagerly, the launchers run inside a plain ``torch.autograd.Function``; under
``torch.compile`` the same function calls the depth kernels as the ``torch.library`` ops
``depthmix::moda_depth_fwd`` / ``depthmix::moda_depth_bwd`` (fake implementations below; no
autograd kernel of their own, the Function is their autograd) and the aten attention ops
trace as they are, so a compiled layer has no graph break. Around the launches: one set of
``[b, h, s, d]`` views serves the backend choice, the attention op and its backward (the
keys' and values' gradients flow back through them), and eagerly the joint log-sum-exp is
written over the attention op's own (no allocation).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend

from depthmix.kernels._common import LibraryOp, empty_like_contiguous, last_dim_contiguous
from depthmix.kernels.moda_attention.function import moda_attention_fused
from depthmix.kernels.moda_attention.reference import _check_shapes
from depthmix.kernels.moda_attention.triton import (
    DepthTiles,
    default_depth_tiles,
    moda_depth_bwd,
    moda_depth_fwd,
)

log = logging.getLogger(__name__)

aten = torch.ops.aten
CPU_FLASH, FLASH, CUDNN = "cpu_flash", "flash", "cudnn"
"""The sequence part's attention ops (:func:`sequence_backend`)."""


# ---------------------------------------------------------------------------------------
# The sequence part: an SDPA op and its backward, log-sum-exp in and out
# ---------------------------------------------------------------------------------------


def sequence_backend(qh: Tensor, kh: Tensor, vh: Tensor, scale: float) -> Optional[str]:
    """Which attention op runs the causal sequence part of ``[b, h, s, d]`` inputs: on CUDA
    the one SDPA itself picks for them (the choice ``causal_sdpa`` gets, see
    ``megatron_ext.attention.sdpa_backend``), if it is cuDNN's or flash attention; the CPU
    flash kernel on the CPU; None where neither applies (the fused kernel runs the layer)."""
    if qh.device.type == "cpu":
        return CPU_FLASH
    if qh.device.type != "cuda":
        return None
    choice = torch._fused_sdp_choice(qh, kh, vh, None, 0.0, True, scale=scale, enable_gqa=True)
    if choice == SDPBackend.CUDNN_ATTENTION.value:
        return CUDNN
    if choice == SDPBackend.FLASH_ATTENTION.value:
        return FLASH
    return None


def _sequence_forward(backend: str, qh: Tensor, kh: Tensor, vh: Tensor, scale: float):
    """``(o [b, h, s, d], natural lse, tensors and sizes the backward takes)``."""
    if backend == CPU_FLASH:
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, True,
                                                                  scale=scale)
        return o, lse, (), ()
    if backend == FLASH:
        o, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = \
            aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, True, False, scale=scale)
        return o, lse, (cum_q, cum_k, rng_state, unused), (max_q, max_k)
    o, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
        aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, True, False,
                                                 scale=scale)
    return o, lse, (cum_q, cum_k, seed, offset), (max_q, max_k)


def _sequence_backward(backend: str, doh: Tensor, qh: Tensor, kh: Tensor, vh: Tensor,
                       oh: Tensor, lse: Tensor, saved: tuple, sizes: tuple, scale: float):
    """``(dq, dk, dv)`` of the sequence part, ``[b, h, s, d]``, given the *joint* output
    and log-sum-exp."""
    if backend == CPU_FLASH:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doh, qh, kh, vh, oh, lse, 0.0, True, scale=scale)
    if backend == FLASH:
        cum_q, cum_k, rng_state, unused = saved
        return aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lse, cum_q, cum_k, *sizes, 0.0, True, rng_state, unused,
            scale=scale)
    cum_q, cum_k, seed, offset = saved
    return aten._scaled_dot_product_cudnn_attention_backward(
        doh, qh, kh, vh, oh, lse, seed, offset, None, cum_q, cum_k, *sizes, 0.0, True,
        scale=scale)


# ---------------------------------------------------------------------------------------
# The depth part: the Triton launchers, or the same as custom ops under torch.compile
# ---------------------------------------------------------------------------------------


def _depth_fwd_body(query: Tensor, depth_key: Tensor, depth_value: Tensor, seq_out: Tensor,
                    seq_lse: Tensor, count: int, scale: float, tiles: List[int]
                    ) -> Tuple[Tensor, Tensor]:
    """``(o [sq, b, np, hn], lse like seq_lse)``; ``tiles`` are a :class:`DepthTiles`' fields."""
    return moda_depth_fwd(query, depth_key, depth_value, seq_out, seq_lse, count, scale,
                          DepthTiles(*tiles))


def _depth_bwd_body(grad_out: Tensor, query: Tensor, depth_key: Tensor, depth_value: Tensor,
                    out: Tensor, lse: Tensor, dq_seq: Tensor, count: int, scale: float,
                    tiles: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dq, ddepth_key, ddepth_value)``."""
    return moda_depth_bwd(grad_out, query, depth_key, depth_value, out, lse, dq_seq, count,
                          scale, DepthTiles(*tiles))


# called inside MoDASplitFunction only (no autograd kernel of their own)
_depth_fwd_op = LibraryOp("depthmix::moda_depth_fwd", _depth_fwd_body)
_depth_bwd_op = LibraryOp("depthmix::moda_depth_bwd", _depth_bwd_body)


@_depth_fwd_op.register_fake
def _(query, depth_key, depth_value, seq_out, seq_lse, count, scale, tiles):
    return empty_like_contiguous(query), torch.empty_like(seq_lse)


@_depth_bwd_op.register_fake
def _(grad_out, query, depth_key, depth_value, out, lse, dq_seq, count, scale, tiles):
    return (empty_like_contiguous(query), torch.empty_like(depth_key),
            torch.empty_like(depth_value))


_tiles_of = functools.lru_cache(maxsize=None)(lambda fields: DepthTiles(*fields))


def _depth_forward(*args):
    if torch.compiler.is_compiling():
        return _depth_fwd_op.default(*args[:-1], list(args[-1]))
    # eagerly the joint log-sum-exp overwrites the sequence part's (read first, row by row)
    return moda_depth_fwd(*args[:-1], _tiles_of(args[-1]), lse_out=args[4])


def _depth_backward(*args):
    if torch.compiler.is_compiling():
        return _depth_bwd_op.default(*args[:-1], list(args[-1]))
    return moda_depth_bwd(*args[:-1], _tiles_of(args[-1]))


class MoDASplitFunction(torch.autograd.Function):
    """Joint sequence + depth attention: the attention op's forward, then the depth kernel
    (which merges); backward, the attention op's backward and the depth kernel's, both
    with the joint output and log-sum-exp. ``qh``, ``kh``, ``vh``: the query, key and
    value as the ``[b, h, s, d]`` views the attention op takes (made once, by the caller,
    which also picks ``backend`` from them); the query's gradient goes to ``query`` (the
    depth kernel adds the sequence part's to its own), the keys' and values' to ``kh`` and
    ``vh``. ``tiles`` are a :class:`DepthTiles`' fields."""

    @staticmethod
    def forward(ctx, query, qh, kh, vh, depth_key, depth_value, count: int, scale: float,
                backend: str, tiles: tuple):
        o_seq, lse_seq, saved, sizes = _sequence_forward(backend, qh, kh, vh, scale)
        out, lse = _depth_forward(query, depth_key, depth_value, o_seq, lse_seq, count, scale,
                                  tiles)  # joint: [sq, b, np, hn], lse like lse_seq
        ctx.save_for_backward(query, qh, kh, vh, depth_key, depth_value, out, lse, *saved)
        ctx.args = (count, scale, backend, tiles, sizes)
        sq, b, np_, hn = query.shape
        return out.view(sq, b, np_ * hn)

    @staticmethod
    def backward(ctx, grad):
        query, qh, kh, vh, depth_key, depth_value, out, lse, *saved = ctx.saved_tensors
        count, scale, backend, tiles, sizes = ctx.args
        do = grad.view(out.shape) if grad.is_contiguous() else grad.reshape(out.shape)
        oh, doh = out.permute(1, 2, 0, 3), do.permute(1, 2, 0, 3)
        dq_seq, dk, dv = _sequence_backward(backend, doh, qh, kh, vh, oh, lse, tuple(saved),
                                            sizes, scale)
        dq, dkd, dvd = _depth_backward(do, query, depth_key, depth_value, out, lse, dq_seq,
                                       count, scale, tiles)
        return dq, None, dk, dv, dkd, dvd, None, None, None, None


@functools.lru_cache(maxsize=None)
def _note_fallback(reason: str) -> None:
    log.info("moda_attention (split): %s; the fused kernel runs these calls", reason)


@functools.lru_cache(maxsize=None)
def _note_backend(backend: str, device: str) -> None:
    log.info("moda_attention (split): the sequence part runs through %s on %s",
             {CPU_FLASH: "the CPU flash kernel", FLASH: "flash attention",
              CUDNN: "cuDNN attention"}[backend], device)


def moda_attention_triton(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    depth_key: Optional[Tensor] = None,
    depth_value: Optional[Tensor] = None,
    depth_count: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    tiles: Optional[DepthTiles] = None,
) -> Tensor:
    """Causal sequence attention and same-position depth attention under one softmax: the
    sequence part through SDPA's attention kernel, the depth part through a Triton kernel,
    merged exactly (``mixer.impl=triton``, ``mixer.moda_kernel=split``).

    Arguments, visibility rule and result as
    :func:`~depthmix.kernels.moda_attention.reference.moda_attention_reference` (without
    ``attention_mask``); ``tiles``: the depth kernels' (default :func:`default_depth_tiles`).
    fp32, bf16 or fp16 inputs; statistics and accumulation in fp32. Decoding (``sq < sk``)
    and CUDA inputs SDPA runs through neither cuDNN nor flash attention take the fused
    kernel (logged once).
    """
    if (depth_key is None) != (depth_value is None):
        raise ValueError("depth_key and depth_value go together")
    if depth_key is not None and depth_value.shape != depth_key.shape:
        raise ValueError(f"depth_value {tuple(depth_value.shape)} != depth_key "
                         f"{tuple(depth_key.shape)}")
    sq, b, np_, hn, sk, ng = _check_shapes(query, key, depth_key)
    if hn > 256:
        raise ValueError(f"moda_attention (Triton) supports head dims <= 256, got {hn}")
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"moda_attention (Triton) takes fp32, bf16 or fp16 inputs, not "
                        f"{query.dtype}")
    if not (query.dtype == key.dtype == value.dtype) or (
            depth_key is not None and not depth_key.dtype == depth_value.dtype == query.dtype):
        raise TypeError("query, key, value and the depth tensors must share one dtype")
    d = 0 if depth_key is None else depth_key.shape[3]
    count = d if depth_count is None else max(0, min(int(depth_count), d))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
    q, k, v = last_dim_contiguous(query, key, value)
    backend = None
    if sq == sk:  # [b, h, s, d] views: the attention op's inputs
        qh, kh, vh = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        backend = sequence_backend(qh, kh, vh, scale)
    if backend is None:
        if not torch.compiler.is_compiling():
            _note_fallback("decoding (sq < sk)" if sq != sk else
                           f"SDPA takes neither cuDNN nor flash attention for {q.dtype} "
                           f"head dim {hn} on {q.device.type}")
        return moda_attention_fused(query, key, value, depth_key, depth_value, depth_count,
                                    softmax_scale)
    if not torch.compiler.is_compiling():
        _note_backend(backend, q.device.type)
    if count == 0:  # plain causal attention
        out = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
    if tiles is None:
        tiles = default_depth_tiles(hn, np_ // ng, d)
    kd, vd = (t if t.is_contiguous() else t.contiguous() for t in (depth_key, depth_value))
    fields = (tiles.block_m, tiles.depth_sub, tiles.block_d, tiles.num_warps, tiles.num_stages)
    return MoDASplitFunction.apply(q, qh, kh, vh, kd, vd, count, scale, backend, fields)


__all__ = ["MoDASplitFunction", "moda_attention_triton", "sequence_backend"]
