"""A sweep in W&B and side by side: one 3-point multirun (Depth-Attention strides 1, 2, 4;
tiny, 3 steps, W&B offline; Hydra's basic launcher) shared by every test here. Each point
runs in its own ``<job number>_<overrides>`` directory with its own config, checkpoints and
W&B run. Its points share one W&B group,
have job type ``train``, model/mixer tags and names that differ only in the stride; an
evaluation of one point's checkpoint joins the group as job type ``eval``; the sweep
directory holds ``summary.csv``/``summary.md`` with each job's own losses (read back from
its ``train.log``), and ``depthmix-sweep-summary`` writes the same table again."""

import csv
import os
import re
import shlex
import subprocess
import time
from types import SimpleNamespace

import pytest
import yaml

from depthmix.cli.sweep import format_cell
from cli_runs import base_env
from run_harness import PYTHON, run_cli
from tools_modules import markdown_rows
from wandb_files import read_run, run_dirs

# one shared sweep: its tests stay on one xdist worker
pytestmark = [pytest.mark.multiproc(at_once=1),
              pytest.mark.xdist_group("test_sweep")]

STRIDES = (1, 2, 4)
LOSS = re.compile(r"run finished at step 3/3 \| train loss ([0-9.]+) \| eval loss ([0-9.]+)")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sweep"))
    env = base_env(tmp, os.path.join(tmp, "cache"))
    started = time.monotonic()
    out = run_cli(["-m", "model=tiny", "mixer=depth_attn",
                   f"mixer.stride={','.join(map(str, STRIDES))}", "train.steps=3",
                   "train.log_interval=1", "train.eval_interval=3", "train.eval_iters=1",
                   "train.micro_batch_size=4", "train.global_batch_size=8",
                   "data.embedded_documents=600", "logger=wandb_offline"],
                  cwd=tmp, env=env, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (key,) = os.listdir(os.path.join(tmp, "multirun", "local"))
    root = os.path.join(tmp, "multirun", "local", key)
    jobs = sorted((d for d in os.listdir(root) if re.match(r"\d+_", d)),
                  key=lambda d: int(d.split("_")[0]))
    return SimpleNamespace(tmp=tmp, root=root, key=key, env=env, stdout=out.stdout,
                           jobs=[os.path.join(root, j) for j in jobs],
                           seconds=time.monotonic() - started)


def _runs(sweep) -> list:
    out = []
    for job in sweep.jobs:
        (run_dir,) = run_dirs(job)
        out.append(read_run(run_dir))
    return out


def test_points_share_a_group_and_differ_only_in_the_stride(sweep):
    runs = _runs(sweep)
    assert len(runs) == 3
    assert {r["group"] for r in runs} == {f"local/{sweep.key}"}
    assert {r["job_type"] for r in runs} == {"train"}
    for r in runs:
        assert r["tags"] == ["model:tiny", "mixer:depth_attn"]
    names = [r["name"] for r in runs]
    stems = {re.sub(r"mixer\.stride=\d+", "S", n) for n in names}
    assert len(stems) == 1 and len(set(names)) == 3, names
    assert [f"mixer.stride={s}" in n for n, s in zip(names, STRIDES)] == [True] * 3
    assert "train.steps" not in names[0] and "model=" not in names[0]
    sweep_id = names[0].rsplit("-", 1)[1]
    assert re.fullmatch(r"[0-9a-f]{6}", sweep_id), names
    for job in sweep.jobs:
        with open(os.path.join(job, "checkpoints", "wandb_group.txt")) as f:
            assert f.read() == f"local/{sweep.key}"


def test_each_point_has_its_own_directory_config_checkpoints_and_wandb_run(sweep):
    assert [os.path.basename(j).split("_", 1)[0] for j in sweep.jobs] == ["0", "1", "2"]
    ids = []
    for job, stride in zip(sweep.jobs, STRIDES):
        assert re.search(rf"mixer\.stride={stride}(,|$)", os.path.basename(job)), job
        with open(os.path.join(job, ".hydra", "config.yaml")) as f:
            assert yaml.safe_load(f)["mixer"]["stride"] == stride
        assert os.path.isdir(os.path.join(job, "checkpoints", "iter_0000003"))
        (run_dir,) = run_dirs(job)
        run = read_run(run_dir)
        assert run["config"]["mixer"]["stride"] == stride
        assert run["config"]["output_dir"] == job
        assert [r["_step"] for r in run["history"] if "train/loss" in r] == [1, 2, 3]
        ids.append(run["id"])
    assert len(set(ids)) == len(STRIDES)


EVAL_LOG = """
import sys
from types import SimpleNamespace
from depthmix.config.schema import LoggerConfig
from depthmix.evaluate.report import log_wandb
run = SimpleNamespace(logger=LoggerConfig(mode="offline", dir=sys.argv[2]), output_dir=".")
results = {"model": "tiny", "mixer": "depth_attn", "step": 3,
           "datasets": {"val": {"loss": 7.0, "ppl": 1096.6}}}
log_wandb(SimpleNamespace(run=run, checkpoint=sys.argv[1]), results)
"""


def test_an_evaluation_joins_the_group(sweep, tmp_path):
    """What ``depthmix-eval`` logs for a checkpoint of the second point (W&B writes its
    files completely when the process ends)."""
    checkpoint = os.path.join(sweep.jobs[1], "checkpoints", "iter_0000003")
    out = subprocess.run([PYTHON, "-c", EVAL_LOG, checkpoint, str(tmp_path)], cwd=sweep.tmp,
                         env=sweep.env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (run_dir,) = run_dirs(str(tmp_path))
    record = read_run(run_dir)
    assert record["group"] == f"local/{sweep.key}" and record["job_type"] == "eval"
    assert "model:tiny" in record["tags"]


def test_summary_has_each_jobs_own_losses(sweep):
    with open(os.path.join(sweep.root, "summary.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["mixer.stride"]) for r in rows] == list(STRIDES)
    for row, job in zip(rows, sweep.jobs):
        with open(os.path.join(job, "train.log")) as f:
            train_loss, eval_loss = map(float, LOSS.search(f.read()).groups())
        assert float(row["train_loss"]) == pytest.approx(train_loss, abs=1e-4)
        assert float(row["eval_loss"]) == pytest.approx(eval_loss, abs=1e-4)
        assert (row["status"], row["exit_code"], row["steps"]) == ("finished", "0", "3/3")
        assert float(row["tokens_per_s"]) > 0 and row["output_dir"] == job
        # each job's own wall time, not the time since the multirun started
        assert 0 < float(row["wall_s"]) < 0.8 * sweep.seconds
    assert "train.steps" not in rows[0] and "model" not in rows[0]
    markdown = markdown_rows(open(os.path.join(sweep.root, "summary.md")).read())
    assert markdown[0][:2] == ["job", "mixer.stride"]
    assert [row[1] for row in markdown[1:]] == [str(s) for s in STRIDES]
    assert "sweep summary:" in sweep.stdout
    # every path printed can be pasted into a shell ('=' and ',' are safe there, '[' not)
    printed = [line.split(": ", 1)[1].split(" (")[0] for line in sweep.stdout.splitlines()
               if line.startswith(("outputs: ", "last checkpoint: "))]
    assert len(printed) == 6
    for path in printed:
        (word,) = shlex.split(path)
        assert os.path.exists(os.path.join(sweep.tmp, word)), path
    assert shlex.split(format_cell("output_dir", "/s/0_train.lr=[1,2]")) == ["/s/0_train.lr=[1,2]"]


def test_sweep_summary_command(sweep):
    os.remove(os.path.join(sweep.root, "summary.csv"))
    out = subprocess.run([PYTHON, "-m", "depthmix.cli.sweep", sweep.root], cwd=sweep.tmp,
                         env=sweep.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(list(csv.DictReader(open(os.path.join(sweep.root, "summary.csv"))))) == 3
    assert "mixer.stride" in out.stdout.splitlines()[0]
    missing = subprocess.run([PYTHON, "-m", "depthmix.cli.sweep", sweep.tmp], cwd=sweep.tmp,
                             env=sweep.env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "sweep_dir" in missing.stderr
