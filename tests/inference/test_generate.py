"""Batched generation of prompts of different lengths equals running each alone, for every
mixer (left padding: per-row positions and a padding mask); top-k/top-p sampling."""

import pytest
import torch

from depthmix.inference.generate import generate, left_pad, sample_next
from depthmix.inference.kv_cache import KVCache
from depthmix.testing import build_model, tiny_run, variant_cases, variant_run

CASES = [pytest.param(mixer, variant, id=test_id)
         for test_id, mixer, variant in variant_cases("generate")]
LENGTHS = (5, 2, 9, 1)


@pytest.mark.parametrize("mixer,variant", CASES)
def test_batched_prompts_of_different_lengths_equal_each_alone(megatron_single, mixer, variant):
    torch.manual_seed(0)
    model = build_model(variant_run(mixer, variant)).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in LENGTHS]
    ids, mask = left_pad(prompts, pad_id=1)
    padding = ids.shape[1] - mask.sum(1)

    with torch.no_grad():  # the padded prefill, real positions only
        batched = model(ids, inference=KVCache(padding))
        for row, prompt in enumerate(prompts):
            alone = model(torch.tensor([prompt]))[0]
            torch.testing.assert_close(batched[row, padding[row]:], alone, rtol=1e-5,
                                       atol=1e-5)

    greedy = generate(model, ids, 6, attention_mask=mask)[:, ids.shape[1]:]
    sampled = generate(model, ids, 6, temperature=1.0, top_p=0.9, attention_mask=mask,
                       generator=[torch.Generator().manual_seed(5) for _ in prompts]
                       )[:, ids.shape[1]:]
    for row, prompt in enumerate(prompts):
        x = torch.tensor([prompt])
        assert torch.equal(generate(model, x, 6)[0, len(prompt):], greedy[row]), (variant, row)
        alone = generate(model, x, 6, temperature=1.0, top_p=0.9,
                         generator=torch.Generator().manual_seed(5))[0, len(prompt):]
        assert torch.equal(alone, sampled[row]), (variant, row)


def test_eos_stops_a_row_and_fills_it(megatron_single):
    torch.manual_seed(0)
    model = build_model(tiny_run("vanilla")).eval()
    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=1)
    free = generate(model, ids, 6, attention_mask=mask)[:, 3:]
    eos = int(free[0, 2])  # row 0 stops at its third token
    out = generate(model, ids, 6, eos_id=eos, attention_mask=mask)[:, 3:]
    assert torch.equal(out[0, :3], free[0, :3]) and bool((out[0, 3:] == eos).all())
    seen = []
    generate(model, ids, 4, attention_mask=mask,
             on_token=lambda token, done: seen.append(token.tolist()))
    assert len(seen) == 4 and all(len(t) == 2 for t in seen)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    g = torch.Generator().manual_seed(0)
    drawn = lambda **kw: set(sample_next(logits, 1.0, generator=g, **kw).tolist())  # noqa: E731
    assert drawn(top_p=0.7) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert drawn(top_p=0.5) == {0}  # the first token alone reaches 0.5
    assert drawn(top_k=3) == {0, 1, 2}
    assert drawn() == {0, 1, 2, 3}
    assert sample_next(logits[:2], 0.0).tolist() == [0, 0]


def test_left_padding_is_checked():
    with pytest.raises(ValueError, match="left padding"):
        generate(None, torch.zeros(1, 3, dtype=torch.long), 1,
                 attention_mask=torch.tensor([[1, 0, 1]]))
