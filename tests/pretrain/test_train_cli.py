"""`depthmix-train` end to end: the embedded default learns, one rank prints; (the full
lane) a multirun over two mixers, each learning in its own directory."""

import re

import pytest

from cli_processes import clean_env, run

pytestmark = pytest.mark.multiproc(at_once=1)

LINE = re.compile(r"^step\s+(\d+)/\d+ \| loss ([0-9.]+)", re.M)


def test_tiny_model_learns_on_the_embedded_corpus(tiny_training):
    _, out = tiny_training
    losses = {int(step): float(loss) for step, loss in LINE.findall(out)}
    assert sorted(losses) == [1, 20, 40, 60], out
    assert losses[1] > 6.0, "the first step should be near ln(vocab)"
    assert losses[60] < 0.5 * losses[1], losses
    assert re.search(r"^eval step\s+60 \| loss [0-9.]+ \| ppl", out, re.M), out


@pytest.mark.full
def test_mixers_learn_in_one_multirun(tmp_path):
    """`depthmix-train -m mixer=a,b`: each mixer trains the tiny model (6 layers, so Block
    AttnRes' default 12-sublayer block fits) with its loss falling, each job in its own
    output directory. Two mixers: every mixer's training through its Hydra config is
    tests/golden (10 steps, TP1 and PP2, bit for bit), multirun's jobs tests/config/test_multirun."""
    mixers = ["vanilla", "attnres_block"]
    proc = run("depthmix-train", [
        "-m", "logger=none", f"hydra.sweep.dir={tmp_path}/sweep",
        f"data.cache_dir={tmp_path}/cache", "model=tiny", "model.num_layers=6",
        f"mixer={','.join(mixers)}", "train.steps=15", "train.log_interval=15",
        "train.eval_interval=0", "train.micro_batch_size=16"], timeout=1200)
    jobs = re.split(r"^\[[^\]]*\]\[HYDRA\]\s+#\d+ : ", proc.stdout, flags=re.M)[1:]
    assert len(jobs) == len(mixers), proc.stdout[-3000:]
    for mixer, job in zip(mixers, jobs):
        assert f" mixer={mixer} " in job.split("\n", 1)[0], job[:300]
        losses = {int(s): float(v) for s, v in LINE.findall(job)}
        assert sorted(losses) == [1, 15], (mixer, job[-1500:])
        assert losses[15] < 0.75 * losses[1], (mixer, losses)  # 0.69 when written
    assert len([d for d in (tmp_path / "sweep").iterdir() if d.is_dir()]) == len(mixers)


# ---- what the README's command prints, and resuming by name -----------------------------
README_RUN = ["model=tiny", "run.name=x", "train.steps=4", "train.log_interval=1",
              "train.eval_interval=2", "train.eval_iters=1", "train.exit_after_steps=2",
              "data.embedded_documents=600"]
NOISE = re.compile(r"warn|Params for bucket|Config\(|^\s|wandb:|TFLOP/s|Traceback", re.I)


def depthmix_train(args, cwd, cache, timeout=300):
    """The installed ``depthmix-train`` script in ``cwd``, as a user runs it: no
    WANDB_SILENT, no DEPTHMIX_RUN_KEY, W&B offline (the default logger)."""
    return run("depthmix-train", args, cwd=cwd, timeout=timeout, installed=True,
               env=clean_env(DEPTHMIX_CACHE_DIR=cache, WANDB_SILENT=None))


@pytest.fixture(scope="module")
def named_runs(tmp_path_factory):
    """The same command twice: steps 1-2 (exit_after_steps), then 3-4."""
    cwd = tmp_path_factory.mktemp("named")
    cache = tmp_path_factory.mktemp("cache")
    return cwd, [depthmix_train(README_RUN, cwd, cache) for _ in range(2)]


@pytest.mark.xdist_group("test_train_cli:named_runs")  # one worker trains them
def test_readme_command_prints_one_line_per_interval_and_a_summary(named_runs):
    cwd, (first, _) = named_runs
    lines = first.stdout.splitlines()
    assert not [line for line in lines if NOISE.search(line)], first.stdout
    assert first.stderr == "", first.stderr
    assert [int(s) for s, _ in LINE.findall(first.stdout)] == [1, 2]
    assert [line for line in lines if line.startswith("eval step")] == \
        [line for line in lines if re.match(r"eval step\s+2 \| loss [0-9.]+ \| ppl", line)] != []
    assert sum(line.startswith("fused kernels: ") for line in lines) == 1
    summary = lines[lines.index(next(x for x in lines if x.startswith("run stopped"))):]
    assert re.match(r"run stopped \(train\.exit_after_steps\) at step 2/4 \| train loss "
                    r"[0-9.]+ \| eval loss [0-9.]+ \| wall \d", summary[0]), summary
    assert summary[1].startswith("outputs: outputs/x (train.log, checkpoints, wandb)")
    assert summary[2] == "last checkpoint: outputs/x/checkpoints/iter_0000002"
    assert summary[3].startswith("W&B (offline): wandb sync ")
    assert summary[4] == "resume: depthmix-train " + " ".join(README_RUN)
    kinds = ("mixer.impl=", "W&B run ", "built the embedded corpus ", "datasets built ",
             "fused kernels: ", "step ", "eval step ", "saved checkpoint ", "run stopped ",
             "outputs: ", "last checkpoint: ", "W&B (offline): ", "resume: ")
    assert [line for line in lines if not line.startswith(kinds)] == [], first.stdout
    log = (cwd / "outputs" / "x" / "train.log").read_text().splitlines()
    for line in lines:  # every console line, in order, in train.log
        log = log[next(i for i, entry in enumerate(log) if entry.endswith(" - " + line)) + 1:]


@pytest.mark.xdist_group("test_train_cli:named_runs")  # one worker trains them
def test_rerunning_a_named_run_resumes_it(named_runs):
    cwd, (_, second) = named_runs
    out = second.stdout
    assert "resumed from " + str(cwd / "outputs/x/checkpoints/iter_0000002") + " at step 2" in out
    assert [int(s) for s, _ in LINE.findall(out)] == [3, 4]
    assert re.search(r"^run finished at step 4/4 \| train loss", out, re.M), out
    assert "resume:" not in out
    assert sorted(p.name for p in (cwd / "outputs").iterdir()) == ["x"]
    log = (cwd / "outputs" / "x" / "train.log").read_text()
    assert "step      2/4" in log and "step      4/4" in log  # both runs, one log file
