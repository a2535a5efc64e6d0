"""``depthmix-train``'s command line: bad options exit 2 before a model is built, naming the
option; ``--help``; multirun dry runs; no Megatron import for help and dry runs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import typing

import pytest

from cli_processes import PYTHON, clean_env, run
from depthmix.cli import overrides as cli
from depthmix.config import schema
from depthmix.mixers import available, get_mixer
from depthmix.config.validate import CHOICES, FREE_TEXT, SYNTAX

GROUP_CLASSES = {"model": schema.ModelConfig, "parallel": schema.ParallelConfig,
                 "data": schema.DataConfig, "train": schema.TrainConfig,
                 "logger": schema.LoggerConfig, "": schema.RunConfig}


def _is_str(cls, f) -> bool:
    hint = typing.get_type_hints(cls)[f.name]
    return hint is str or hint == typing.Optional[str]


def _typo(value: str) -> str:
    return value[:-1] + ("q" if value[-1] != "q" else "z")


def string_option_typos() -> list:
    """(overrides, option, closest value) for every string option with a set of allowed
    values, generated from the dataclasses (a new string option is covered automatically)."""
    cases = []
    for group, cls in GROUP_CLASSES.items():
        for f in dataclasses.fields(cls):
            option = f"{group}.{f.name}" if group else f.name
            if _is_str(cls, f) and option in CHOICES:
                good = CHOICES[option][0]
                cases.append(([f"{option}={_typo(good)}"], option, good))
    seen = set()
    for name in available():
        cls = get_mixer(name).config_cls
        for option, allowed in cls.CHOICES.items():
            if option not in seen:
                seen.add(option)
                cases.append(([f"mixer={name}", f"mixer.{option}={_typo(allowed[0])}"],
                              f"mixer.{option}", allowed[0]))
    return cases


def test_every_string_option_is_classified():
    """A string option either has allowed values (then a typo is tested below), takes any
    text (a name or a path), or has its own syntax check."""
    unclassified = []
    for group, cls in GROUP_CLASSES.items():
        for f in dataclasses.fields(cls):
            option = f"{group}.{f.name}" if group else f.name
            if _is_str(cls, f) and option not in {*CHOICES, *FREE_TEXT, *SYNTAX}:
                unclassified.append(option)
    for name in available():
        cls = get_mixer(name).config_cls
        for f in dataclasses.fields(cls):
            if _is_str(cls, f) and f.name != "name" and f.name not in cls.CHOICES:
                unclassified.append(f"mixer.{f.name} (mixer={name})")
    assert not unclassified, ("string options without allowed values: add them to "
                              f"depthmix.config.validate.CHOICES (or FREE_TEXT): {unclassified}")


HYDRA_LEVEL = [  # refused before Hydra runs: the same for a dry run and a training run
    (["mixer=depth_atn"], "mixer=depth_atn", "depth_attn"),
    (["train.lrr=1"], "train.lrr", "train.lr"),
    (["mixer=depth_attn", "mixer.strid=3"], "mixer.strid", "mixer.stride"),
    (["train.lr=[1"], "cannot parse the overrides", None),
]
BAD_VALUES = [  # refused by the preflight the dry run and the trainer share
    (["train.lr=-1"], "train.lr=-1", None),
    (["train.lr_decay_style=cosinus"], "train.lr_decay_style='cosinus'", "cosine"),
    (["data.split=abc"], "data.split='abc'", None),
    (["data.split='0,2,0'"], "data.split='0,2,0'", None),
    *string_option_typos(),
]
BAD_OPTIONS = [*((*case, "dry_run") for case in HYDRA_LEVEL),
               *((*case, path) for case in BAD_VALUES for path in ("dry_run", "trainer"))]
# by default each bad value through one of the two paths, in turn; the other in the full lane
DEFAULT_PATH = {tuple(case[0]): ("dry_run", "trainer")[i % 2] for i, case in enumerate(BAD_VALUES)}


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """In-process ``depthmix-train``: building a process group or a model fails the test."""
    from depthmix.pretrain import trainer

    def forbidden(*args, **kwargs):
        raise AssertionError("a bad option must be refused before anything is built")

    monkeypatch.setattr(trainer, "init_distributed", forbidden)
    monkeypatch.setattr(trainer, "build_model", forbidden)
    monkeypatch.setenv("DEPTHMIX_RUN_KEY", "test")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)


def run_main(monkeypatch, args) -> int:
    """The exit status: returned, or raised from inside Hydra's job."""
    from depthmix.cli.train import main

    monkeypatch.setattr(sys, "argv", ["depthmix-train", "logger=none", *args])
    try:
        return main()
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("overrides, option, suggestion, path", [
    pytest.param(*case, id=f"{' '.join(case[0])}-{case[3]}",
                 marks=() if DEFAULT_PATH.get(tuple(case[0]), "dry_run") == case[3]
                 else pytest.mark.full) for case in BAD_OPTIONS])
def test_bad_option_exits_2_naming_it(no_model, monkeypatch, capsys, overrides, option,
                                      suggestion, path):
    extra = ["train.dry_run=true"] if path == "dry_run" else []
    assert run_main(monkeypatch, [*overrides, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0], err
    if suggestion:
        assert f"did you mean '{suggestion}'" in err[0], err


@pytest.mark.parametrize("name", available())
def test_every_shipped_mixer_starts_with_the_defaults(tmp_path, name):
    from depthmix.config.load import compose_run
    from depthmix.pretrain.preflight import preflight

    run = compose_run(f"mixer={name}", f"output_dir={tmp_path}")
    preflight(run, world_size=1)


def test_help_lists_real_choices_and_describes_every_option():
    text = cli.help_text()
    assert "_schema" not in text and "powered by Hydra" not in text
    assert text.startswith("depthmix-train")
    assert "(undocumented)" not in text, [l for l in text.splitlines() if "undocumented" in l]
    mixers = [f"{n}*" if n == "vanilla" else n for n in available()]
    assert f"mixer: {', '.join(mixers)}\n" in text
    for name in available():
        for f in dataclasses.fields(get_mixer(name).config_cls):
            if f.name != "name":
                assert f"  mixer.{f.name}: " in text, f.name
    assert "did you mean" not in text


# ------------------------------------------------------------------------ real processes
PROBE = """
import json, sys
from depthmix.cli.train import main
sys.argv = ["depthmix-train", *sys.argv[1:]]
try:
    code = main()
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "megatron": any(m.split(".")[0] == "megatron"
                  for m in sys.modules), "torch": "torch" in sys.modules}))
"""


def depthmix_train(tmp_path, *args, probe=False) -> subprocess.CompletedProcess:
    env = clean_env(DEPTHMIX_RUN_KEY="test", WORLD_SIZE=None)
    if probe:
        return subprocess.run([PYTHON, "-c", PROBE, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180)
    return run("depthmix-train", args, cwd=tmp_path, env=env, timeout=180, check=False)


def probe(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.multiproc(at_once=1)
def test_help_dry_run_and_preprocess_do_not_import_megatron(tmp_path):
    helped = depthmix_train(tmp_path, "--help", probe=True)
    assert probe(helped) == {"code": 0, "megatron": False, "torch": False}, helped.stderr
    assert "mixer=depth_attn options:" in helped.stdout and "_schema" not in helped.stdout

    env = clean_env()
    preprocess = subprocess.run(
        [sys.executable, "-c", "import sys; from depthmix.cli.preprocess import main\n"
         "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
         "print('megatron' in sys.modules)"], env=env, capture_output=True, text=True,
        timeout=120)
    assert preprocess.stdout.strip().splitlines()[-1] == "False", preprocess.stderr

    planned = depthmix_train(tmp_path, "model=3b", "parallel=tp2_pp4", "train=paper",
                             "train.dry_run=true", "parallel.world_size=64", probe=True)
    assert "dry run OK for world size 64" in planned.stdout, planned.stderr[-2000:]
    result = probe(planned)
    assert result["code"] == 0 and not result["megatron"], result


@pytest.mark.parametrize("override, names", [
    ("mixer=depth_atn", "did you mean 'depth_attn'"),
    ("train.lrr=1", "did you mean 'train.lr'"),
])
@pytest.mark.multiproc(at_once=1)
def test_hydra_level_errors_exit_2(tmp_path, override, names):
    proc = depthmix_train(tmp_path, override)  # a training run, not a dry run
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [l for l in proc.stderr.splitlines() if l.strip()]
    assert line.startswith("configuration error: ") and names in line


@pytest.mark.multiproc(at_once=1)
def test_multirun_dry_run_checks_every_point(tmp_path):
    proc = depthmix_train(tmp_path, "-m", "mixer=attnres_block", "mixer.block_size=4,8,12",
                          "train.dry_run=true")
    verdicts = [l for l in proc.stdout.splitlines() if l.startswith("[")]
    assert verdicts[:2] == ["[ok] mixer.block_size=4 (world size 1)",
                            "[ok] mixer.block_size=8 (world size 1)"], proc.stdout
    assert verdicts[2].startswith("[error] mixer.block_size=12: mixer.block_size=12 is "
                                  "larger than the number of sublayers"), proc.stdout
    assert len(verdicts) == 3 and proc.returncode == 2
    assert not os.path.exists(tmp_path / "multirun"), "a dry run launches no jobs"


UNPICKLE = """
import pickle, sys
from omegaconf import OmegaConf
task = pickle.load(open(sys.argv[1], "rb"))
print(task.__module__, OmegaConf.has_resolver("dm.run_key"), OmegaConf.has_resolver("dm.named"))
"""


@pytest.mark.multiproc(at_once=1)
def test_a_submitit_job_registers_the_resolvers_as_it_unpickles_the_task(tmp_path):
    """Hydra's SLURM launcher (submitit) cloudpickles the task into each job, which resolves
    its output directory (``${dm.run_key:}``) before the task runs: nothing registers the
    resolvers at import, so unpickling the task must."""
    path = tmp_path / "task.pkl"
    subprocess.run([sys.executable, "-c", "import cloudpickle, sys\n"
                    "from depthmix.cli.train import job\n"
                    "open(sys.argv[1], 'wb').write(cloudpickle.dumps(job))", str(path)],
                   check=True, timeout=120, env=clean_env())
    job = subprocess.run([sys.executable, "-c", UNPICKLE, str(path)], capture_output=True,
                         text=True, timeout=120, env=clean_env())
    assert job.stdout.split() == ["depthmix.cli.train", "True", "True"], job.stderr[-2000:]


@pytest.mark.multiproc(at_once=1)
def test_help_shows_the_composed_values(tmp_path):
    proc = depthmix_train(tmp_path, "model=tiny", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "  model.seq_length: int = 128\n" in proc.stdout
    assert "  run.name: Optional[str] = null\n" in proc.stdout
    assert not [l for l in proc.stdout.splitlines() if l.strip() == "hydra:"]
    assert "\n  hydra: " not in proc.stdout


def test_logger_options_interpolate_the_run_config():
    from depthmix.config.load import compose_run

    run = compose_run("mixer=depth_attn", "mixer.stride=2", "logger.name=da-s${mixer.stride}",
                      "logger.group=g${train.steps}")
    assert (run.logger.name, run.logger.group) == ("da-s2", f"g{run.train.steps}")


@pytest.mark.multiproc(at_once=1)
def test_a_refused_run_leaves_no_output_directory(tmp_path):
    proc = depthmix_train(tmp_path, "logger.name=x${mixer.nope}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == ("configuration error: logger.name: Interpolation key "
                                   "'mixer.nope' not found"), proc.stderr
    assert not os.path.exists(tmp_path / "outputs" / "test"), os.listdir(tmp_path / "outputs")


@pytest.mark.parametrize("env, cpus, threads", [
    ({"OMP_NUM_THREADS": "3"}, 8, 3),
    ({"LOCAL_WORLD_SIZE": "2"}, 8, 4),
    ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 8, 2),
    ({"LOCAL_WORLD_SIZE": "8"}, 2, 1),
])
def test_torch_threads_share_the_cpus_among_local_ranks(monkeypatch, env, cpus, threads):
    from depthmix.runtime import env as launch_env

    monkeypatch.setattr(launch_env.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert launch_env.torch_threads(env) == threads


@pytest.mark.multiproc(at_once=1)
def test_a_local_sweep_runs_every_point_and_reports_the_failures(tmp_path):
    """Both points are refused at start-up (exit 2): the second still runs, the summary
    lists both with their status, and the sweep exits with it."""
    import csv

    proc = depthmix_train(tmp_path, "-m", "mixer.stride=1,2", "mixer=depth_attn",
                          "logger.name=x${mixer.nope}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("configuration error: ") == 2, proc.stderr
    with open(tmp_path / "multirun" / "test" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mixer.stride"], r["status"], r["exit_code"]) for r in rows] == \
        [("1", "failed", "2"), ("2", "failed", "2")]
    assert "sweep summary: multirun/test/summary.md" in proc.stdout
