"""``megatron_ext.rope.apply_rope``: Megatron's unfused RoPE, bit for bit, with its tables
made once per forward."""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from depthmix.megatron_ext.context import ForwardContext
from depthmix.megatron_ext.rope import apply_rope


class _Config:
    apply_rope_fusion = rotary_interleaved = multi_latent_attention = False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("per_row", [False, True], ids=["positions", "per-row"])
def test_outputs_and_gradients_equal_megatrons(megatron_single, dtype, per_row):
    """Forward and backward of a strided query view (as the QKV split hands it over), for
    the shared positions ``[s, 1, 1, d]`` and a left-padded batch's ``[s, b, 1, d]``;
    the second call reuses the first's tables."""
    s, b, heads, d = 7, 3, 4, 16
    freqs = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_base=10000,
                            use_cpu_initialization=True)(s + 2)
    if per_row:
        rows = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7]])
        freqs = freqs[rows.t(), 0]  # [s, b, 1, d]
    else:
        freqs = freqs[:s]
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(s, b, heads, 3 * d, generator=g, dtype=dtype)
    grads = [torch.randn(s, b, heads, d, generator=g, dtype=dtype) for _ in range(2)]
    ctx = ForwardContext(rotary_pos_emb=freqs)
    results = []
    for rotate in (lambda t: apply_rotary_pos_emb(t, freqs, config=_Config()),
                   lambda t: apply_rope(t, ctx, _Config())):
        x = mixed.clone().requires_grad_()
        outs = [rotate(x[..., :d]), rotate(x[..., d:2 * d])]
        torch.autograd.backward(outs, grads)
        results.append((*outs, x.grad))
    for ours, theirs in zip(results[1], results[0]):
        assert ours.dtype == theirs.dtype
        assert torch.equal(ours, theirs)
    assert len([k for k in ctx.extras if k[0] == "rope"]) == 1  # tables made once


def test_other_options_take_megatrons_function(megatron_single):
    """A partial rotary dim (or interleaved halves, TE's fusion) is Megatron's to apply."""
    s, d = 5, 8
    freqs = torch.randn(s, 1, 1, d // 2)
    t = torch.randn(s, 2, 3, d)
    ctx = ForwardContext(rotary_pos_emb=freqs)
    assert torch.equal(apply_rope(t, ctx, _Config()),
                       apply_rotary_pos_emb(t, freqs, config=_Config()))
    assert not ctx.extras
