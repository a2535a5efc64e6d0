import torch

from depthmix.testing import build_model, incremental_logits, tiny_run


def test_incremental_decoding_matches_full_forward(megatron_single):
    torch.manual_seed(0)
    model = build_model(tiny_run("vanilla"), dtype=torch.float64).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        full = model(ids)
    inc = incremental_logits(model, ids, prefill=3)
    torch.testing.assert_close(inc, full, rtol=1e-9, atol=1e-9)
