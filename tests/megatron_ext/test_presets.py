"""The paper presets instantiate (on the meta device) with their closed-form sizes."""

import pytest
import torch

from depthmix.config.load import compose_run
from depthmix.megatron_ext.config import to_transformer_config
from depthmix.megatron_ext.model import build_chunk
from depthmix.mixers import get_mixer

PRESETS = {  # name: (hidden, ffn, layers, heads, kv heads) from the papers' model tables
    "360m": (960, 2540, 24, 15, 15),
    "500m": (1152, 3072, 24, 18, 18),
    "710m": (1280, 3072, 32, 20, 20),
    "1p5b": (1536, 4096, 48, 24, 6),
    "3b": (2048, 6912, 48, 32, 8),
}


def closed_form(h, f, layers, heads, kv, vocab=50304, head_dim=64):
    attention = h * (heads + 2 * kv) * head_dim + heads * head_dim * h + 2 * head_dim
    mlp = h * 2 * f + f * h
    per_layer = attention + mlp + 2 * h
    return 2 * vocab * h + layers * per_layer + h


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_parameter_count(preset, megatron_single):
    run = compose_run(f"model={preset}")
    h, f, layers, heads, kv = PRESETS[preset]
    m = run.model
    assert (m.hidden_size, m.ffn_hidden_size, m.num_layers, m.num_attention_heads,
            m.num_query_groups) == (h, f, layers, heads, kv)
    config = to_transformer_config(run)
    config.perform_initialization = False
    with torch.device("meta"):
        model = build_chunk(config, get_mixer("vanilla"))
    count = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert count == closed_form(h, f, layers, heads, kv)
    if preset in ("1p5b", "3b"):
        nominal = {"1p5b": 1.5e9, "3b": 3.0e9}[preset]
        assert 0.85 * nominal < count < 1.15 * nominal, f"{preset}: {count / 1e9:.2f}B"
