"""Depth-Attention written straight from the Depth-Attention paper, one layer and one token at a
time.

For tests only: :func:`reference_logits` recomputes a :class:`DepthMixModel`'s logits from
its weights with explicit Python loops over the (unrolled) layers, the token positions and
the heads, following the paper's equations literally. It shares nothing
with the vectorised path but the weights (and Megatron's RoPE angle table).

Per layer ``l`` and position ``t`` (eqs. 2-3 of the Depth-Attention paper; GQA as in its section
3.3)::

    q̄ = mean of the G query heads of the group
    a_j = softmax_j( q̄ · k_j / sqrt(d_h) ),  j in S(l) ∪ {l}      (or 1 / (|S(l)| + 1))
    ṽ_l = a_l v_l + Σ_{j in S(l)} a_j ṽ_j        (mixed_state value / key_value)
    k̃_l = a_l k_l + Σ_{j in S(l)} a_j k_j        (mixed_state key / key_value)

then causal attention of each query head over the (possibly mixed) keys and values of
positions ``0..t``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def reference_sources(layer: int, stride: int, mode: str, stored_layers=None) -> list:
    """S(layer) by the definition: anchored ``{j < l : j mod s = 0}``, relative ``{l - ks}``;
    with ``stored_layers = N`` (a looped stack) also every earlier run of the same stored
    layer, ``{j < l : j mod N = l mod N}``."""
    if mode == "anchored":
        sources = [j for j in range(layer) if j % stride == 0]
    else:
        sources, j = [], layer - stride
        while j >= 0:
            sources.append(j)
            j -= stride
    if stored_layers:
        sources += [j for j in range(layer) if j % stored_layers == layer % stored_layers]
    return sorted(set(sources))


def _rms_norm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _rope(x, angles):
    """Rotate-half RoPE (Megatron's non-interleaved layout): pairs ``(i, i + hn/2)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cos(angles) + rotated * torch.sin(angles)


def reference_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of a single-rank, pre-norm depth-attention ``model``."""
    config = model.config
    opts = config.mixer
    assert config.norm_position == "pre", "the reference covers pre-norm blocks"
    stride, mode, rule, state = opts.stride, opts.source_mode, opts.mix_rule, opts.mixed_state
    assert stride is not None, "resolve the mixer config first"
    ng, hn = config.num_query_groups, config.kv_channels
    G = config.num_attention_heads // ng
    eps = config.layernorm_epsilon
    b, s = input_ids.shape
    angles = model.rotary_pos_emb(s)[:, 0, 0, :]  # [s, hn]

    h = model.embedding.word_embeddings.weight[input_ids]  # [b, s, d]
    keys, mixed_values = {}, {}  # per unrolled layer: raw keys k_j, mixed values ṽ_j [b,s,ng,hn]
    layers = list(model.decoder.layers)
    stored = len(layers) if opts.own_loops and config.n_loops > 1 else None
    for loop in range(config.n_loops):
        for i, layer in enumerate(layers):
            u = loop * len(layers) + i
            attn = layer.self_attention
            # ---- projections, QK-norm, RoPE ---------------------------------------------
            x = _rms_norm(h, layer.input_layernorm.weight, eps)
            qkv = (x @ attn.linear_qkv.weight.t()).view(b, s, ng, G + 2, hn)
            q = _rms_norm(qkv[:, :, :, :G], attn.q_layernorm.weight, eps)  # [b, s, ng, G, hn]
            k = _rms_norm(qkv[:, :, :, G], attn.k_layernorm.weight, eps)  # [b, s, ng, hn]
            v = qkv[:, :, :, G + 1]
            q = torch.stack([_rope(q[:, t], angles[t]) for t in range(s)], dim=1)
            k = torch.stack([_rope(k[:, t], angles[t]) for t in range(s)], dim=1)

            # ---- depth attention, position by position, group by group ------------------
            sources = reference_sources(u, stride, mode, stored)
            k_att_rows, v_att_rows = [], []
            for t in range(s):
                k_row, v_row = [], []
                for g in range(ng):
                    q_bar = q[:, t, g].mean(dim=1)  # [b, hn]
                    cand_k = [keys[j][:, t, g] for j in sources] + [k[:, t, g]]
                    cand_v = [mixed_values[j][:, t, g] for j in sources] + [v[:, t, g]]
                    if rule == "softmax":
                        scores = torch.stack([(q_bar * kj).sum(-1) / math.sqrt(hn)
                                              for kj in cand_k], dim=-1)
                        a = torch.softmax(scores, dim=-1)  # [b, |S| + 1]
                    else:
                        a = torch.full((b, len(cand_k)), 1.0 / len(cand_k), dtype=q.dtype)
                    k_mix = sum(a[:, n, None] * cand_k[n] for n in range(len(cand_k)))
                    v_mix = sum(a[:, n, None] * cand_v[n] for n in range(len(cand_v)))
                    k_row.append(k_mix if state in ("key", "key_value") else k[:, t, g])
                    v_row.append(v_mix if state in ("value", "key_value") else v[:, t, g])
                k_att_rows.append(torch.stack(k_row, dim=1))
                v_att_rows.append(torch.stack(v_row, dim=1))
            k_att = torch.stack(k_att_rows, dim=1)  # [b, s, ng, hn]
            v_att = torch.stack(v_att_rows, dim=1)
            keys[u], mixed_values[u] = k, v_att

            # ---- causal sequence attention, query position by position, head by head ----
            context = []
            for t in range(s):
                heads = []
                for g in range(ng):
                    for r in range(G):
                        scores = (k_att[:, : t + 1, g] * q[:, t, g, r, None]).sum(-1)
                        p = torch.softmax(scores / math.sqrt(hn), dim=-1)  # [b, t + 1]
                        heads.append((p[..., None] * v_att[:, : t + 1, g]).sum(1))
                context.append(torch.cat(heads, dim=-1))
            context = torch.stack(context, dim=1)  # [b, s, np * hn]
            h = h + context @ attn.linear_proj.weight.t()

            # ---- SwiGLU MLP ---------------------------------------------------------------
            x = _rms_norm(h, layer.pre_mlp_layernorm.weight, eps)
            gate, up = (x @ layer.mlp.linear_fc1.weight.t()).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ layer.mlp.linear_fc2.weight.t()

    h = _rms_norm(h, model.final_layernorm.weight, eps)
    return h @ model.output_layer.weight.t()
