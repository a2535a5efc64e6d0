"""The routing arithmetic of a top-k mixture-of-experts layer, written from the papers one
token and one expert at a time (tests only; float64):

* Switch Transformer (Fedus, Zoph, Shazeer) and GShard (Lepikhin et al.): softmax router
  probabilities, the top-k experts of each token, the auxiliary load-balancing loss
  ``E * sum_i f_i * P_i`` (``f_i`` the share of the token-expert assignments expert ``i``
  got, ``P_i`` its mean router probability), expert capacity ``ceil(k * T / E * factor)``
  with the tokens over capacity dropped;
* ST-MoE (Zoph et al.): the router z-loss, the mean over tokens of ``logsumexp(logits)^2``;
* DeepSeek-V3 technical report: sigmoid affinities, the top-k chosen on affinity + expert
  bias, gating weights the chosen affinities renormalised (times the routed scaling factor),
  the bias update ``b_i += gamma * sign(mean load - load_i)`` once per step, the
  complementary sequence-wise balance loss (``f_i``, ``P_i`` per sequence over the
  normalised affinities ``s_i / sum_j s_j``), shared experts every token goes through.

Qwen3-MoE's ``norm_topk_prob``: the k chosen softmax probabilities renormalised to sum to 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def scores_of(logits, score_function: str):
    """Router probabilities (softmax) or affinities (sigmoid), ``[T, E]``."""
    return logits.softmax(-1) if score_function == "softmax" else logits.sigmoid()


def route(logits, moe, bias=None):
    """Gating weights ``[T, E]`` (zero off the chosen experts) and the choice ``[T, E]``."""
    T, E = logits.shape
    scores = scores_of(logits, moe.score_function)
    weights = torch.zeros_like(scores)
    chosen = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        by = scores[t] + bias if bias is not None else scores[t]
        experts = sorted(range(E), key=lambda i: -float(by[i]))[:moe.top_k]
        w = torch.stack([scores[t, i] for i in experts])
        sigmoid_renorm = moe.score_function == "sigmoid" and moe.top_k > 1
        if sigmoid_renorm or (moe.score_function == "softmax" and moe.normalize_top_k):
            w = w / w.sum()
        if moe.routed_scaling_factor:
            w = w * moe.routed_scaling_factor
        for j, i in enumerate(experts):
            weights[t, i] = w[j]
            chosen[t, i] = True
    return weights, chosen


def drop_over_capacity(weights, chosen, moe):
    """Each expert keeps at most its capacity of assignments, those of the largest weights."""
    T, E = chosen.shape
    capacity = math.ceil(moe.top_k * T / E * moe.capacity_factor)
    keep = torch.zeros_like(chosen)
    for i in range(E):
        tokens = sorted((t for t in range(T) if chosen[t, i]), key=lambda t: -float(weights[t, i]))
        for t in tokens[:capacity]:
            keep[t, i] = True
    return weights * keep, keep


def balance_loss(logits, moe):
    """``E * sum_i f_i * P_i`` over these tokens: ``f_i`` counts the top-k of the plain
    scores (no expert bias, before any dropping) over ``T * k``; ``P_i`` averages the
    normalised scores."""
    T, E = logits.shape
    s = scores_of(logits, moe.score_function)
    s = s / s.sum(-1, keepdim=True)
    counts = [0] * E
    for t in range(T):
        for i in sorted(range(E), key=lambda i: -float(s[t, i]))[:moe.top_k]:
            counts[i] += 1
    return E * sum(counts[i] / (T * moe.top_k) * s[:, i].mean() for i in range(E))


def aux_loss(logits, moe, seq_length: int):
    """The load-balancing loss of a micro-batch of tokens ordered ``[s, b]``: over all its
    tokens (``batch``), or per sequence and averaged (``sequence``)."""
    if moe.aux_loss_scope == "batch":
        return balance_loss(logits, moe)
    per_seq = logits.view(seq_length, -1, logits.shape[-1])
    return torch.stack([balance_loss(per_seq[:, b], moe)
                        for b in range(per_seq.shape[1])]).mean()


def z_loss(logits):
    return torch.stack([torch.logsumexp(row, 0) ** 2 for row in logits]).mean()


def swiglu(x, fc1, fc2):
    """Megatron's gated MLP: ``fc1`` holds the gate rows, then the up rows."""
    gate, up = (x @ fc1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.t()


def moe_layer(x, weights, experts, shared=None):
    """``y_t = sum_i w_ti * E_i(x_t)`` (+ the shared expert), ``experts[i] = (fc1, fc2)``."""
    out = []
    for t in range(x.shape[0]):
        y = sum(weights[t, i] * swiglu(x[t], *experts[i])
                for i in range(len(experts)) if weights[t, i] != 0)
        y = y if torch.is_tensor(y) else torch.zeros_like(x[t])
        out.append(y + swiglu(x[t], *shared) if shared is not None else y)
    return torch.stack(out)


def updated_bias(bias, load, rate: float):
    """DeepSeek-V3's auxiliary-loss-free update after a step with ``load[i]`` tokens on
    expert ``i``: up for the underloaded, down for the overloaded."""
    mean = sum(load) / len(load)
    return torch.tensor([b + rate * math.copysign(1.0, mean - n) if n != mean else b
                         for b, n in zip(bias.tolist(), load)], dtype=bias.dtype)
