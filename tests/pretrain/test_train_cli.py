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


def test_every_mixer_learns_in_one_multirun(tmp_path):
    """`depthmix-train -m mixer=a,b,...`: each mixer trains the tiny model (6 layers, so
    Block AttnRes' default 12-sublayer block fits) with its loss falling, each job in its
    own output directory."""
    from depthmix.megatron_ext.mixers import available

    mixers = available()
    cmd = [sys.executable, "-m", "depthmix.pretrain.train", "-m", "logger=none",
           f"hydra.sweep.dir={tmp_path}/sweep", f"data.cache_dir={tmp_path}/cache",
           "model=tiny", "model.num_layers=6", f"mixer={','.join(mixers)}", "train.steps=30",
           "train.log_interval=30",
           "train.eval_interval=0", "train.micro_batch_size=16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = re.split(r"^\[[^\]]*\]\[HYDRA\]\s+#\d+ : ", proc.stdout, flags=re.M)[1:]
    assert len(jobs) == len(mixers), proc.stdout[-3000:]
    for mixer, job in zip(mixers, jobs):
        assert f" mixer={mixer} " in job.split("\n", 1)[0], job[:300]
        losses = {int(s): float(v) for s, v in LINE.findall(job)}
        assert sorted(losses) == [1, 30], (mixer, job[-1500:])
        assert losses[30] < 0.75 * losses[1], (mixer, losses)
    assert len([d for d in (tmp_path / "sweep").iterdir() if d.is_dir()]) == len(mixers)
