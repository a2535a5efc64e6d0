import torch

from depthmix.testing import build_model, tiny_run


def test_cached_generation_equals_recomputing_the_prefix(megatron_single):
    from depthmix.inference.generate import generate

    torch.manual_seed(1)
    model = build_model(tiny_run("vanilla"), dtype=torch.float64).eval()
    prompt = torch.randint(0, 128, (2, 4))
    cached = generate(model, prompt, max_new_tokens=8)
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, seq)
