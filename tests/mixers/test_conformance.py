"""What every mixer in the registry must satisfy, whatever its method (fp64, tiny models):

* incremental decoding (a prefill, then one token at a time through the KV cache) gives
  the full forward's logits;
* full activation recomputation gives the same logits bit for bit and the same parameter
  gradients (to fp64 round-off where an entry read by several sublayers of a checkpointed
  layer has its gradient summed in another order).

The cases are the option sets each method's own tests exercise; a mixer added to the
registry without cases here fails :func:`test_every_registered_mixer_has_cases`.
The pipeline transport's rules are checked per mixer in ``tests/megatron_ext/test_transport.py``.
"""

from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch
from resop_reference import assert_recompute_matches, ids_for

from depthmix.mixers import available
from depthmix.testing import build_model, incremental_logits, tiny_run


@dataclass(frozen=True)
class Case:
    mixer: str
    options: dict = field(default_factory=dict)
    kv_heads: Optional[int] = None  # None: tiny_run's GQA (2 KV heads for 4 query heads)
    layers: int = 4
    n_loops: int = 1
    norm: str = "pre"
    prefill: int = 3
    decode: bool = True
    recompute: bool = True
    recompute_rtol: float = 0.0
    """Norm-wise gradient tolerance; 0 means identical."""

    def build(self, recompute: bool = False):
        run = tiny_run(self.mixer, **self.options)
        m = run.model
        m.num_layers, m.n_loops, m.norm_position = self.layers, self.n_loops, self.norm
        if self.kv_heads is not None:
            m.num_query_groups = self.kv_heads
        if recompute:
            run.parallel.recompute = "full"
        model = build_model(run, dtype=torch.float64)
        assert model.config.recompute_granularity == ("full" if recompute else None)
        return perturb(model)


MHA = 4  # tiny_run has 4 query heads
SUMMED = 1e-12  # gradients summed in another order under recomputation

CASES = {
    "vanilla": Case("vanilla", recompute=False),
    "vanilla-swa3": Case("vanilla", {"short_swa_window": 3}),
    "attnres_full": Case("attnres_full", recompute_rtol=SUMMED),
    "attnres_block4": Case("attnres_block", {"block_size": 4}, recompute_rtol=SUMMED),
    "ddl-vc3": Case("ddl", {"value_channels": 3}),
    "ddl-vc2-swa3": Case("ddl", {"value_channels": 2, "short_swa_window": 3}, recompute=False),
    "denseformer-k2p1": Case("denseformer", {"dilation": 2, "period": 1},
                             recompute_rtol=SUMMED),
    "depth_attn-gqa": Case("depth_attn", {"stride": 1}, recompute_rtol=SUMMED),
    "depth_attn-mha": Case("depth_attn", {"stride": 1}, kv_heads=MHA, recompute=False),
    "depth_attn-gqa-key_value": Case("depth_attn", {"stride": 1, "mixed_state": "key_value"},
                                     recompute_rtol=SUMMED),
    "depth_attn-gqa-looped": Case("depth_attn", {"stride": 1}, layers=2, n_loops=2,
                                  recompute=False),
    "mhc-n3": Case("mhc", {"variant": "mhc", "streams": 3}),
    "hc-n3": Case("mhc", {"variant": "hc", "streams": 3}),
    "identity-n3": Case("mhc", {"variant": "identity", "streams": 3}),
    "mhc-n2-swa3": Case("mhc", {"streams": 2, "short_swa_window": 3}, recompute=False),
    "hc-n2-swa3": Case("mhc", {"variant": "hc", "streams": 2, "short_swa_window": 3},
                       recompute=False),
    "moda-gqa-prefill1": Case("moda", prefill=1),
    "moda-attnkv-w3-post-prefill5": Case("moda", {"attn_kv_proj": True, "depth_window": 3},
                                         norm="post", prefill=5),
    "moda-noffn-mha-prefill1": Case("moda", {"ffn_kv_proj": False}, kv_heads=MHA, prefill=1,
                                    recompute=False),
    "moda-w2-post-mha": Case("moda", {"depth_window": 2}, kv_heads=MHA, norm="post",
                             recompute=False),
}


def perturb(model, seed=0):
    """Move the mixing parameters and the norm gains off their init (zero pseudo-queries,
    unit gains, identity-like gates make a model too symmetric to catch a misplaced
    index); the same draws for every model built from one case."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if getattr(p, "no_weight_decay", False) or "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def cases(check):
    return [pytest.param(case, id=name) for name, case in CASES.items() if getattr(case, check)]


def test_every_registered_mixer_has_cases():
    for check in ("decode", "recompute"):
        covered = {case.mixer for case in CASES.values() if getattr(case, check)}
        assert covered == set(available()), f"{check}: {sorted(set(available()) - covered)}"


@pytest.mark.parametrize("case", cases("decode"))
def test_incremental_decoding_matches_full_forward(megatron_single, case):
    model = case.build().eval()
    ids = ids_for(seq=model.config.seq_length)
    with torch.no_grad():
        full = model(ids)
    inc = incremental_logits(model, ids, prefill=case.prefill)
    assert inc.shape == full.shape
    torch.testing.assert_close(inc, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", cases("recompute"))
def test_recompute_gives_identical_gradients(megatron_single, case):
    plain, recomputed = case.build(), case.build(recompute=True)
    grads = assert_recompute_matches(plain, recomputed, ids_for(seq=plain.config.seq_length),
                                     rtol=case.recompute_rtol)
    assert len(grads) == sum(1 for _ in plain.parameters())  # every parameter is reached
