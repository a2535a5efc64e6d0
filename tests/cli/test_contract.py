"""Every command holds depthmix-train's contract (``depthmix.cli.command``), as a real
process: a typo'd option exits 2 naming the closest valid one and a missing path exits 2
naming it, both before torch, Megatron or W&B is imported (they are made unimportable
here) and in under 3 s of CPU time; a normal run prints no library line."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
HEAVY = ("torch", "megatron", "wandb", "transformers", "lm_eval")
LAUNCH = """
import runpy, sys
for name in {heavy!r}:
    sys.modules[name] = None  # importing it raises ImportError
sys.argv = {argv!r}
if sys.argv[0].endswith(".py"):
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
NOISE = re.compile(r"megatron|^wandb:|warn|FSDP", re.I | re.M)


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DEPTHMIX_RUN_KEY", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def refused(argv, cwd):
    """Run ``argv`` (a module or a tool script, then its arguments) without the heavy
    libraries; returns (exit status, stderr, CPU seconds, wall seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", LAUNCH.format(heavy=HEAVY, argv=argv)],
                          capture_output=True, text=True, cwd=cwd, env=_env(), timeout=120)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.stdout == "", proc.stdout
    return proc.returncode, proc.stderr, cpu, wall


TYPOS = {
    "eval": (["depthmix.cli.eval", "eval.dataset={a: /x}"], "'eval.datasets'"),
    "generate": (["depthmix.cli.generate", "ckpt", "-p", "hi", "--tempreature", "1"],
                 "'--temperature'"),
    "export": (["depthmix.cli.export", "ckpt", "out", "--dtyp", "bf16"], "'--dtype'"),
    "overheads": (["depthmix.cli.overheads", "model.seq_lenght=64"], "'model.seq_length'"),
    "preprocess": (["depthmix.cli.preprocess", "-i", "a", "-t", "b", "-o", "c",
                    "--json-kee", "text"], "'--json-key'"),
    "import": (["depthmix.cli.importer", "a", "b", "--seq-lenght", "8"], "'--seq-length'"),
    "bench_inference": ([os.path.join(TOOLS, "bench_inference.py"), "--prefil", "8"],
                        "'--prefill'"),
    "bench_mixers": ([os.path.join(TOOLS, "bench_mixers.py"), "--stepz", "8"], "'--steps'"),
    "bench_kernels": ([os.path.join(TOOLS, "bench_kernels.py"), "--opps", "x"], "'--ops'"),
}


@pytest.mark.multiproc(at_once=1)
@pytest.mark.parametrize("name", sorted(TYPOS))
def test_a_typo_exits_2_naming_the_closest_option_at_once(name, tmp_path):
    argv, closest = TYPOS[name]
    status, err, cpu, wall = refused(argv, tmp_path)
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and f"did you mean {closest}" in err, err
    assert cpu < 3, f"{cpu:.1f} s of CPU ({wall:.1f} s wall)"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The README's tiny model after one step (its tokenizer beside the weights)."""
    root = tmp_path_factory.mktemp("tiny")
    proc = subprocess.run(
        [sys.executable, "-m", "depthmix.cli.train", "model=tiny", "train.steps=1",
         "logger=none", "train.eval_interval=0", "data.embedded_documents=600",
         f"hydra.run.dir={root}/run", f"data.cache_dir={root}/cache"],
        capture_output=True, text=True, cwd=root, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (data,) = (root / "cache" / "embedded").glob("*/text_document.bin")
    return str(root / "run" / "checkpoints"), str(data)[:-4]


def _missing(checkpoint):
    ckpt, _ = checkpoint
    return {
        "eval-checkpoint": (["depthmix.cli.eval", "eval.checkpoint=/no/ckpt",
                             "eval.datasets={a: /no/data}"], "eval.checkpoint=/no/ckpt"),
        "eval-dataset": (["depthmix.cli.eval", f"eval.checkpoint={ckpt}",
                          "eval.datasets={a: /no/data}"], "eval.datasets.a=/no/data"),
        "eval-output": (["depthmix.cli.eval", f"eval.checkpoint={ckpt}", "eval.tasks=[x]",
                         "eval.output=/dev/null/r.json"], "eval.output=/dev/null"),
        "generate": (["depthmix.cli.generate", "/no/ckpt", "-p", "hi"], "checkpoint=/no/ckpt"),
        "generate-prompts": (["depthmix.cli.generate", ckpt, "-f", "/no/p.txt"],
                             "--prompts-file=/no/p.txt"),
        "export": (["depthmix.cli.export", "/no/ckpt", "out"], "checkpoint=/no/ckpt"),
        "preprocess": (["depthmix.cli.preprocess", "-i", "/no/d.jsonl", "-t", "t", "-o", "o"],
                       "--input=/no/d.jsonl"),
        "import": (["depthmix.cli.importer", "/no/model", "out"], "hf_dir=/no/model"),
    }


@pytest.mark.multiproc(at_once=1)
@pytest.mark.xdist_group("test_contract:checkpoint")  # one worker trains it
@pytest.mark.parametrize("case", ["eval-checkpoint", "eval-dataset", "eval-output",
                                  "generate", "generate-prompts", "export", "preprocess",
                                  "import"])
def test_a_missing_path_exits_2_naming_it_at_once(case, checkpoint, tmp_path):
    argv, named = _missing(checkpoint)[case]
    status, err, cpu, wall = refused(argv, tmp_path)
    assert status == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert cpu < 3, f"{cpu:.1f} s of CPU ({wall:.1f} s wall)"
    assert os.listdir(tmp_path) == []  # no output directory for a refused command


def _quiet_run(args, cwd):
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          cwd=cwd, env=_env(), timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert not NOISE.search(text), text
    return proc.stdout


@pytest.mark.multiproc(at_once=1)
@pytest.mark.xdist_group("test_contract:checkpoint")
def test_normal_runs_print_no_library_lines_and_eval_writes_beside_its_results(checkpoint,
                                                                               tmp_path):
    ckpt, data = checkpoint
    results = tmp_path / "results" / "val.json"
    out = _quiet_run(["depthmix.cli.eval", f"eval.checkpoint={ckpt}",
                      f"eval.datasets={{val: {data}}}", "eval.max_windows=2",
                      "logger=wandb_offline", f"eval.output={results}"], tmp_path)
    assert "wandb sync results/wandb/offline-run-" in out, out
    assert json.loads(results.read_text())["datasets"]["val"]["tokens"] == 256
    assert sorted(os.listdir(results.parent)) == ["val.json", "val.log", "wandb"]
    assert sorted(os.listdir(tmp_path)) == ["results"]  # no outputs/<time>/eval/
    _quiet_run(["depthmix.cli.generate", ckpt, "-p", "Once upon a time", "-n", "3"], tmp_path)
    _quiet_run(["depthmix.cli.export", ckpt, str(tmp_path / "hf")], tmp_path)
    _quiet_run(["depthmix.cli.overheads", "model=tiny", "--mixers", "depth_attn,moda"],
               tmp_path)


@pytest.mark.multiproc
def test_a_two_rank_run_with_sequence_and_expert_parallelism_prints_no_library_lines(tmp_path):
    """TP2 + sequence parallelism with EP2 experts (Megatron's gathers, reduce-scatters and
    the dispatcher's all-to-all run from the first step, after start-up): no library line,
    and each start-up line once, not once per rank."""
    proc = subprocess.run(
        [sys.executable, "-m", "depthmix.runtime.torchrun", "--standalone",
         "--nproc-per-node=2", "-m", "depthmix.cli.train", "model=tiny_moe", "parallel.tp=2",
         "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.expert_tp=1",
         "train.steps=2", "train.eval_interval=0", "train.save_interval=0", "logger=none"],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert not NOISE.search(text), text
    lines = [line for line in text.splitlines() if line.strip()]
    assert sum("experts_impl" in line for line in lines) == 1, text
    assert sum(line.startswith("step ") for line in lines) == 2, text
