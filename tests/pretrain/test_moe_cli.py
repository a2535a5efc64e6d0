"""``depthmix-train model=tiny_moe``: the command trains with experts and its console shows
their losses and load (one run in the default lane; every mixer learning in the slow lane)."""

import re

import pytest

from cli_processes import run
from depthmix.mixers import available

LINE = re.compile(r"^step\s+(\d+)/\d+ \| loss ([0-9.]+) \| aux ([0-9.]+) \| z ([0-9.e+-]+) ",
                  re.M)
EXPERTS = re.compile(r"^experts step\s+(\d+) \| load max/mean ([0-9.]+) at layer (\d+) "
                     r"\(.* tokens\) \| dropped 0 of ([0-9,]+) \(0\.00%\)$", re.M)


@pytest.mark.multiproc(at_once=1)
def test_console_shows_the_experts_losses_and_load(tmp_path):
    proc = run("depthmix-train", [
        "model=tiny_moe", "mixer=attnres_block", "logger=none", f"hydra.run.dir={tmp_path}/run",
        f"data.cache_dir={tmp_path}/cache", "data.embedded_documents=600", "train.steps=4",
        "train.log_interval=2", "train.eval_interval=0", "train.micro_batch_size=4",
        "train.global_batch_size=8"], timeout=600)
    steps = [int(s) for s, *_ in LINE.findall(proc.stdout)]
    loads = EXPERTS.findall(proc.stdout)
    assert steps == [1, 2, 4] and [int(s) for s, *_ in loads] == steps, proc.stdout[-3000:]
    # 8 samples x 128 tokens x top-2 over layers 1-3, per step since the last log line
    assert [a for *_, a in loads] == ["6,144", "6,144", "12,288"], loads


@pytest.mark.full
@pytest.mark.multiproc(at_once=1)
def test_every_mixer_learns_over_experts(tmp_path):
    """``depthmix-train model=tiny_moe mixer=<m> logger=none`` for every registered mixer
    (one multirun): each one's loss falls and its console shows the experts."""
    mixers = available()
    proc = run("depthmix-train", [
        "-m", "model=tiny_moe", "logger=none", f"mixer={','.join(mixers)}",
        f"hydra.sweep.dir={tmp_path}/sweep", f"data.cache_dir={tmp_path}/cache",
        "train.steps=15", "train.log_interval=15", "train.eval_interval=0",
        "train.micro_batch_size=16"], timeout=3000)
    jobs = re.split(r"^\[[^\]]*\]\[HYDRA\]\s+#\d+ : ", proc.stdout, flags=re.M)[1:]
    assert len(jobs) == len(mixers), proc.stdout[-3000:]
    for mixer, job in zip(mixers, jobs):
        losses = {int(s): float(v) for s, v, *_ in LINE.findall(job)}
        assert sorted(losses) == [1, 15] and losses[15] < 0.8 * losses[1], (mixer, job[-1500:])
        assert len(EXPERTS.findall(job)) == 2, (mixer, job[-1500:])
