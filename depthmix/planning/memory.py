"""Closed-form memory of one pipeline rank (any TP/DP rank of a stage): the one model the
dry run and the planner (``depthmix-plan``) read. Megatron-free.

Notation: ``P`` params on the rank, ``e`` activation bytes (4 fp32, else 2), ``b`` micro
batch, ``s`` sequence, ``h`` hidden, ``f`` FFN, ``H``/``H_kv`` query/KV heads *on the TP
rank* (divided by ``tp``), ``d_h`` head dim, ``V`` padded vocabulary, ``t`` = ``tp`` under
sequence parallelism else 1 (hidden-side tensors live on the sequence shard).

State (bytes)::

    weights    P * (4 fp32 | 2 bf16/fp16)
    gradients  P * 4                         Megatron's main grads (grad_reduce_in_fp32)
    optimizer  P * (8 fp32 | 12 bf16/fp16)   Adam moments (+ fp32 master weights),
                                             / dp with the distributed optimizer; the
                                             routed experts' / (dp / ep), their
                                             expert-data-parallel group

Saved for backward per micro-batch and token, one decoder layer (elements; what the
layer's autograd graph holds with the SDPA core, measured by tests/planning/memory_probe.py)::

    norms      2 (3h + 1) / t       per RMSNorm: input, 1/rms, normalised, scaled output
    attention  5 H d_h + 4 H_kv d_h + 2 H + H_kv
                                    QKV output, q copy, q/k norms (input, normalised, 1/rms),
                                    SDPA's q, k, output and log-sum-exp
    MLP        5 f                  fused gate|up output, silu input/output, product
    RoPE       4 s d_h / (b s)      cos/sin tables of q and k, per micro-batch
    ShortSWA   (3h + 1) / t + attention, when ``mixer.short_swa_window > 0``

On an MoE layer the MLP term is the MoE layer's instead (router, permutation, the routed
rows at the experts, the shared expert: :mod:`depthmix.planning.experts`), at a balanced
router (``k`` rows a token); :attr:`RankMemory.routing_bound_bytes` is what the rank would
hold on top were the routing at its bound (dropless: every token of the EP group sent to
this rank's experts; with a capacity factor: every expert full).

plus the mixer's own saved tensors and depth state (``Mixer.saved_activations``), the
embedding's token ids (8 bytes a token) on the first chunk and, on the last, the final
norm ``(3h + 1) / t`` and the logits ``V`` (an fp32 copy for the loss unless fp32).

Full recomputation keeps, per micro-batch, only the depth-state tensors the layers of a
chunk receive (each entry version once: the checkpoint inputs) and re-builds one layer's
activations at a time in backward (one layer's worth, once per rank).

Micro-batches in flight at the 1F1B peak (``r`` pipeline rank, ``m`` micro-batches)::

    1F1B         min(m, P - r)
    interleaved  min(m V, 2 (P - r - 1) + (V - 1) P + 1)    chunk-micro-batches

A rank's activation peak: in flight x the mean of its chunks' per-micro-batch bytes, plus
the head's (one micro-batch: its backward follows at once) and, with recomputation, the
one rebuilt layer.

Pipeline buffers: each in-flight micro-batch holds its received tensor (the transport's
wire size) and the rank sends one at a time: ``(in flight + 1) x wire bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from depthmix.config.schema import RunConfig
from depthmix.config.validate import data_parallel_size
from depthmix.planning.experts import Experts
from depthmix.planning.flops import stored_layer_expert_params, stored_layer_params
from depthmix.planning.pipeline import PipelineLayout, geometry_of
from depthmix.planning.shape import Shape

RESERVE_GIB = 4.0
"""Left free on every device for the CUDA context, NCCL buffers and fragmentation."""


def activation_bytes_of(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def state_bytes_per_param(precision: str, distributed_optimizer: bool, dp: int) -> dict:
    """Weights, gradients and optimizer state per parameter (see module doc)."""
    weights = 4 if precision == "fp32" else 2
    optim = 8 if precision == "fp32" else 12
    return {"weights": weights, "grads": 4,
            "optimizer": optim / dp if distributed_optimizer else optim}


def vanilla_layer_elems(x: Shape, tp: int, sp: bool, micro_batch: int) -> float:
    """Elements per token one decoder layer saves (module doc), on one TP rank."""
    t = tp if sp else 1
    heads, kv, dh = x.num_attention_heads / tp, x.num_query_groups / tp, x.kv_channels
    norms = 2 * (3 * x.hidden_size + 1) / t
    if x.qk_layernorm:
        attention = 5 * heads * dh + 4 * kv * dh + 2 * heads + kv
    else:
        attention = 3 * heads * dh + 2 * kv * dh + heads
    rope = 4 * dh / micro_batch
    swa = (3 * x.hidden_size + 1) / t + attention + rope if x.short_swa_window > 0 else 0.0
    return norms + attention + 5 * x.ffn_hidden_size / tp + rope + swa


def head_bytes_per_token(x: Shape, tp: int, sp: bool, act: int) -> float:
    """Final norm and logits (an fp32 copy for the loss unless already fp32)."""
    t = tp if sp else 1
    logits = x.vocab_size / tp * (act if act == 4 else act + 4)
    return (3 * x.hidden_size + 1) / t * act + logits


def inflight_microbatches(pp: int, vp: int, pp_rank: int, num_micro: int) -> int:
    """Chunk-micro-batches whose activations a rank holds at the 1F1B peak."""
    if vp == 1:
        return min(num_micro, pp - pp_rank)
    return min(num_micro * vp, (pp - pp_rank - 1) * 2 + (vp - 1) * pp + 1)


@dataclass
class RankMemory:
    pp_rank: int
    global_ranks: str
    chunks: List[dict]  # {"chunk", "layers": range, "embedding", "head"}
    params: int
    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    saved_per_micro: List[float]  # bytes one micro-batch saves, per chunk of the rank
    recompute_layer_bytes: float  # one layer's activations re-built in backward (recompute)
    inflight_microbatches: int
    activation_bytes: float  # at the pipeline peak
    payload_bytes: int  # most depth state + hidden sent to the next stage, per micro-batch
    wire_bytes: int  # what the transport actually exchanges per transition
    p2p_buffer_bytes: float
    expert_params: int = 0  # the routed experts' share of ``params``
    expert_state_bytes: float = 0.0  # their weights, gradients and optimizer state
    moe_activation_bytes: float = 0.0  # the MoE layers' MLPs' share of the activation peak
    routing_bound_bytes: float = 0.0  # more at the peak were the routing at its bound

    @property
    def state_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes + self.p2p_buffer_bytes


def _chunk_of_layer(x: Shape, layout: PipelineLayout):
    """Unrolled layer -> its pipeline chunk (a looped model's loops share the stored layer)."""
    per = layout.layers_per_chunk
    return lambda u: (u % x.num_layers) // per


def _recompute_inputs(geometry, chunk: int, chunk_layers: List[int], elem: int,
                      micro_batch: int, views: dict) -> float:
    """Bytes of the depth-state tensors the chunk's checkpointed layers receive, each entry
    version once (a checkpoint saves its inputs). An entry that is a view of a larger
    tensor (``Mixer.view_entries``: a reused value inside its layer's QKV output) keeps
    that whole tensor alive; what the chunk received is one packed wire tensor."""
    seen, total = set(), 0
    if chunk > 0:
        start = geometry.layout.start(chunk)
        seen = {(e.name, e.version_at(start)) for e in geometry.entering(chunk).sent}
        total = geometry.wire_bytes(chunk, micro_batch, elem)
    for u in chunk_layers:
        for entry in geometry.plan.live_at(u):
            key = (entry.name, entry.version_at(u))
            if key in seen:
                continue
            seen.add(key)
            if entry.name in views:
                total += views[entry.name] * geometry.seq_length * micro_batch * elem
            else:
                total += geometry.numel_per_sample(entry) * micro_batch * elem
    return total


_GEOMETRIES: dict = {}
_RECOMPUTE_INPUTS: dict = {}


def _geometry(run: RunConfig, mixer, config, layout: PipelineLayout):
    """The transport's geometry (cached: the planner asks for thousands of layouts)."""
    p = run.parallel
    key = (repr(run.model), repr(run.mixer), mixer.plan, layout, p.tp, p.sequence_parallel)
    if key not in _GEOMETRIES:
        _GEOMETRIES[key] = geometry_of(mixer.plan, config, layout, p.tp)
    return _GEOMETRIES[key]


def estimate(run: RunConfig, mixer, world_size: int, config=None) -> List[RankMemory]:
    """Per pipeline rank (all TP/DP ranks of a stage are alike); see the module doc.
    ``mixer``: the run's :class:`~depthmix.mixers.base.Mixer` (its hooks); ``config``: what
    they read (default the run's :class:`Shape`)."""
    p, t = run.parallel, run.train
    x, moe = Shape.of(run), Experts.of(run)
    tp, pp, vp, sp, ep = p.tp, p.pp, p.vp or 1, p.sequence_parallel, p.ep
    dp = data_parallel_size(run, world_size)
    config = config if config is not None else x
    extra = mixer.extra_params(config, tp)
    saved = mixer.saved_activations(config, tp, t.micro_batch_size)
    layout = PipelineLayout(x.num_layers, pp, vp)
    per_layer_params = stored_layer_params(x, tp, extra, moe, ep)
    per_layer_experts = stored_layer_expert_params(x, moe, tp, ep)
    act = activation_bytes_of(t.precision)
    b = t.micro_batch_size
    tokens = b * x.seq_length
    num_micro = t.global_batch_size // (b * dp)
    geometry = _geometry(run, mixer, config, layout)
    views = mixer.view_entries(config, tp)
    per_param = state_bytes_per_param(t.precision, p.distributed_optimizer, dp)
    per_expert_param = state_bytes_per_param(t.precision, p.distributed_optimizer,
                                             max(dp // ep, 1))  # the expert-DP group
    chunk_of = _chunk_of_layer(x, layout)
    vanilla = vanilla_layer_elems(x, tp, sp, b)
    layer_bytes = {u: (vanilla + saved.layers.get(u, 0.0)) * tokens * act
                   for u in range(x.unrolled_layers)}
    moe_bytes = {u: 0.0 for u in layer_bytes}  # the MoE MLP's share of each layer
    bound_bytes = dict(moe_bytes)  # more, at the routing bound
    if moe is not None:
        mlp = moe.saved_bytes(tokens, b, tp, sp, act)
        bound = moe.saved_bytes(tokens, b, tp, sp, act, moe.rows_bound(tokens, tp, sp, ep))
        for u in layer_bytes:
            if moe.is_moe(u):
                layer_bytes[u] += mlp - 5 * x.ffn_hidden_size / tp * tokens * act
                moe_bytes[u], bound_bytes[u] = mlp, bound - mlp
    recompute = p.recompute == "full"

    out = []
    for r in range(pp):
        chunks, params, experts, payload, wire, per_micro = [], 0, 0, 0, 0, []
        moe_micro, bound_micro = [], []
        head_bytes, rebuilt, rebuilt_moe, rebuilt_bound = 0.0, 0.0, 0.0, 0.0
        for v in range(vp):
            c = layout.chunk(r, v)
            first, last = c == 0, c == layout.num_chunks - 1
            layers = layout.layers(c)
            params += sum(per_layer_params[i] for i in layers)
            experts += sum(per_layer_experts[i] for i in layers)
            unrolled = [u for u in range(x.unrolled_layers) if chunk_of(u) == c]
            if recompute:
                key = (id(geometry), c, act, b)
                if key not in _RECOMPUTE_INPUTS:
                    _RECOMPUTE_INPUTS[key] = _recompute_inputs(geometry, c, unrolled, act, b,
                                                               views)
                held = _RECOMPUTE_INPUTS[key]
                biggest = max(unrolled, key=lambda u: layer_bytes[u])
                if layer_bytes[biggest] > rebuilt:
                    rebuilt, rebuilt_moe = layer_bytes[biggest], moe_bytes[biggest]
                rebuilt_bound = max([rebuilt_bound] + [bound_bytes[u] for u in unrolled])
                moe_micro.append(0.0)
                bound_micro.append(0.0)
            else:
                held = sum(layer_bytes[u] for u in unrolled)
                moe_micro.append(sum(moe_bytes[u] for u in unrolled))
                bound_micro.append(sum(bound_bytes[u] for u in unrolled))
            if first:
                params += x.vocab_size * x.hidden_size // tp + extra.stem
                held += 8 * tokens  # token ids
            if last:  # tied on one stage: the embedding is the output layer
                own_output = not (first and x.tie_embeddings)
                params += own_output * x.vocab_size * x.hidden_size // tp + x.hidden_size \
                    + extra.head
                head_bytes = (head_bytes_per_token(x, tp, sp, act) + saved.head * act) * tokens
            else:
                payload = max(payload, geometry.payload_bytes(c + 1, b, act))
                wire = max(wire, geometry.wire_bytes(c + 1, b, act))
            per_micro.append(held + (head_bytes if last else 0.0))
            chunks.append({"chunk": c, "layers": layers, "embedding": first, "head": last})
        inflight = inflight_microbatches(pp, vp, r, num_micro)
        body = [m - (head_bytes if ch["head"] else 0.0) for m, ch in zip(per_micro, chunks)]
        activation = inflight * sum(body) / len(body) + head_bytes + rebuilt
        received = wire if r > 0 or vp > 1 else 0
        buffers = (inflight * received + wire) if pp > 1 else 0.0
        lo, hi = r * tp * dp, (r + 1) * tp * dp - 1
        dense = params - experts
        out.append(RankMemory(
            pp_rank=r, global_ranks=f"{lo}-{hi}" if hi > lo else f"{lo}", chunks=chunks,
            params=params, weight_bytes=params * per_param["weights"],
            grad_bytes=params * per_param["grads"],
            optimizer_bytes=(dense * per_param["optimizer"]
                             + experts * per_expert_param["optimizer"]),
            saved_per_micro=per_micro,
            recompute_layer_bytes=rebuilt, inflight_microbatches=inflight,
            activation_bytes=activation, payload_bytes=payload, wire_bytes=wire,
            p2p_buffer_bytes=buffers, expert_params=experts,
            expert_state_bytes=experts * sum(per_expert_param.values()),
            moe_activation_bytes=inflight * sum(moe_micro) / len(moe_micro) + rebuilt_moe,
            routing_bound_bytes=inflight * sum(bound_micro) / len(bound_micro) + rebuilt_bound))
    return out
