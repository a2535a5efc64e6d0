"""`depthmix-train` end to end: the embedded default learns, one rank prints."""

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

LINE = re.compile(r"^step\s+(\d+)/\d+ \| loss ([0-9.]+)", re.M)


def train(tmp_path, *overrides, timeout=600):
    cmd = [sys.executable, "-m", "depthmix.pretrain.train", "logger=none",
           f"hydra.run.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_tiny_model_learns_on_the_embedded_corpus(tmp_path):
    out = train(tmp_path, "model=tiny", "train.steps=60", "train.log_interval=20",
                "train.eval_interval=60", "train.eval_iters=2")
    losses = {int(step): float(loss) for step, loss in LINE.findall(out)}
    assert sorted(losses) == [1, 20, 40, 60], out
    assert losses[1] > 6.0, "the first step should be near ln(vocab)"
    assert losses[60] < 0.5 * losses[1], losses
    assert re.search(r"^eval step\s+60 \| loss [0-9.]+ \| ppl", out, re.M), out
