"""What every mixer in the registry must satisfy, whatever its method (fp64, tiny models):

* incremental decoding (a prefill, then one token at a time through the KV cache) gives
  the full forward's logits;
* full activation recomputation gives the same logits bit for bit and the same parameter
  gradients (to fp64 round-off where an entry read by several sublayers of a checkpointed
  layer has its gradient summed in another order).

The cases are each mixer's variants in the ``decode`` and ``recompute`` checks
(``Mixer.variants``, declared in its folder; the registry refuses a mixer without them).
The pipeline transport's rules are checked per mixer in ``tests/megatron_ext/test_transport.py``.
"""

import pytest
import torch
from resop_reference import assert_recompute_matches, ids_for

from depthmix.testing import build_model, incremental_logits, variant_cases, variant_run


def build(mixer, variant, recompute: bool = False):
    run = variant_run(mixer, variant)
    if recompute:
        run.parallel.recompute = "full"
    model = build_model(run, dtype=torch.float64)
    assert model.config.recompute_granularity == ("full" if recompute else None)
    return perturb(model)


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
    return [pytest.param(mixer, variant, id=test_id)
            for test_id, mixer, variant in variant_cases(check)]


@pytest.mark.parametrize("mixer,variant", cases("decode"))
def test_incremental_decoding_matches_full_forward(megatron_single, mixer, variant):
    model = build(mixer, variant).eval()
    ids = ids_for(seq=model.config.seq_length)
    with torch.no_grad():
        full = model(ids)
    inc = incremental_logits(model, ids, prefill=variant.prefill)
    assert inc.shape == full.shape
    torch.testing.assert_close(inc, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mixer,variant", cases("recompute"))
def test_recompute_gives_identical_gradients(megatron_single, mixer, variant):
    plain, recomputed = build(mixer, variant), build(mixer, variant, recompute=True)
    grads = assert_recompute_matches(plain, recomputed, ids_for(seq=plain.config.seq_length),
                                     rtol=variant.recompute_rtol)
    assert len(grads) == sum(1 for _ in plain.parameters())  # every parameter is reached
