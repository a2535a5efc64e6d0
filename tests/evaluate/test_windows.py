"""The window rule of ``depthmix-eval``: every token but the first predicted exactly once,
whatever the data-parallel size, batch size and micro-batch count."""

import numpy as np
import pytest

from depthmix.evaluate.windows import microbatches, num_windows, steps, window


def _predicted(tokens, total, s, dp, b, m):
    """(target token, its input token at the previous position) of every unmasked
    position, over all steps and DP ranks."""
    seen = []
    for k in range(steps(total, dp, b, m)):
        for r in range(dp):
            for batch in microbatches(tokens, total, s, k, r, dp, b, m):
                assert batch["tokens"].shape == (b, s) and batch["position_ids"].shape == (b, s)
                mask = batch["loss_mask"].bool()
                seen += batch["labels"][mask].tolist()
                # the input at each scored position is the token just before its target
                assert (batch["tokens"][mask] == batch["labels"][mask] - 1).all()
    return seen


@pytest.mark.parametrize("n, s, dp, b, m", [(101, 10, 1, 1, 1), (100, 10, 2, 3, 2),
                                             (161, 16, 4, 2, 1), (17, 16, 3, 1, 2)])
def test_every_token_but_the_first_is_predicted_once(n, s, dp, b, m):
    tokens = np.arange(n)
    total = num_windows(n, s)
    assert total == -(-(n - 1) // s)
    assert sorted(_predicted(tokens, total, s, dp, b, m)) == list(range(1, n))


def test_windows_share_one_token_and_the_last_is_partial():
    tokens = np.arange(25)
    first, second = window(tokens, 0, 10), window(tokens, 1, 10)
    assert first["tokens"].tolist() == list(range(10))
    assert first["labels"].tolist() == list(range(1, 11))
    assert second["tokens"][0] == first["labels"][-1] == 10
    last = window(tokens, 2, 10)  # tokens 20..24: 4 targets, 6 padded positions
    assert last["loss_mask"].tolist() == [1.0] * 4 + [0.0] * 6
    assert last["labels"][:4].tolist() == [21, 22, 23, 24]
    assert num_windows(25, 10) == 3 and num_windows(21, 10) == 2


def test_max_windows_caps_what_is_scored():
    tokens = np.arange(200)
    seen = _predicted(tokens, 3, 10, dp=2, b=2, m=1)
    assert sorted(seen) == list(range(1, 31))
