"""Every training command in README.md and docs/ works for the model it names.

Each line of a ```bash block that runs the trainer (``depthmix-train``, ``torchrun ... -m
depthmix.cli.train``, ``launch/local.sh``, ``launch/slurm/train.sbatch``) is
dry-run in this process (``train.dry_run=true``) at the world size the command implies,
every multirun point separately (the points of ``sweep=`` files included).
``depthmix-preprocess`` and ``depthmix-sweep-summary`` lines are parsed by their argument
parsers; the other CLIs (eval,
generate, export) are not checked here. Paths under ``/data/`` are redirected to copies of
the embedded corpus's files, so commands for real corpora are checked too.
"""

from __future__ import annotations

import functools
import glob
import io
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = [os.path.join(REPO, "README.md"),
             *sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]
GPUS_PER_NODE = 8  # what the launch scripts assume without NPROC_PER_NODE / GPU count


@dataclass
class DocCommand:
    where: str  # file:line
    text: str
    program: str  # depthmix-train | depthmix-preprocess
    args: List[str] = field(default_factory=list)
    world_size: Optional[int] = None
    """Processes the launcher starts; None: one process unless ``parallel.world_size``."""


def bash_commands(path: str):
    """(line number, command) for each command in the file's ```bash blocks: continuation
    lines joined, ``a && b`` split, comments dropped."""
    in_block, pending, start = False, "", 0
    with open(path) as f:
        for number, line in enumerate(f, 1):
            stripped = line.strip()
            if stripped.startswith("```"):
                in_block = stripped == "```bash"
                continue
            if not in_block or (not pending and (not stripped or stripped.startswith("#"))):
                continue
            if not pending:
                start = number
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            for part in (pending + stripped).split("&&"):
                words = shlex.split(part, comments=True)
                if words:
                    yield start, words
            pending = ""


def _option(words, *names, default=None):
    for i, w in enumerate(words):
        for name in names:
            if w == name and i + 1 < len(words):
                return words[i + 1]
            if w.startswith(name + "="):
                return w.split("=", 1)[1]
    return default


def classify(where: str, words: List[str]):
    """A :class:`DocCommand` for a trainer / preprocess command, else None."""
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words:
        return None
    text = shlex.join(words)
    if words[0] == "depthmix-train":
        return DocCommand(where, text, "depthmix-train", words[1:])
    if words[0] in ("depthmix-preprocess", "depthmix-sweep-summary"):
        return DocCommand(where, text, words[0], words[1:])
    if words[0] == "torchrun" and "depthmix.cli.train" in words:
        args = words[words.index("depthmix.cli.train") + 1:]
        nodes = int(_option(words, "--nnodes", default="1").split(":")[-1])
        nproc = int(_option(words, "--nproc-per-node", "--nproc_per_node", default="1"))
        return DocCommand(where, text, "depthmix-train", args, nodes * nproc)
    if words[0] == "launch/local.sh":
        nproc = int(env.get("NPROC_PER_NODE", GPUS_PER_NODE))
        return DocCommand(where, text, "depthmix-train", words[1:], nproc)
    if words[0] == "sbatch" and "launch/slurm/train.sbatch" in words:
        args = words[words.index("launch/slurm/train.sbatch") + 1:]
        nodes = int(_option(words, "--nodes", "-N", default="1"))
        return DocCommand(where, text, "depthmix-train", args, nodes * GPUS_PER_NODE)
    return None


def doc_commands() -> List[DocCommand]:
    out = []
    for path in DOC_FILES:
        rel = os.path.relpath(path, REPO)
        for number, words in bash_commands(path):
            command = classify(f"{rel}:{number}", list(words))
            if command is not None:
                out.append(command)
    return out


def sweep_points(args: List[str]) -> tuple:
    """Hydra's basic sweeper's expansion: ``hydra.sweeper.params`` of the composed config
    (sweep files) plus the command line's comma lists -> one override list per job; and
    the world size of each job under ``launcher=slurm`` (None for the local launcher)."""
    from hydra import compose, initialize_config_module
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from depthmix.config.store import register_configs
    from depthmix.runtime.env import register_resolvers

    parser = OverridesParser.create()
    if not any(a.startswith(("sweep=", "launcher=")) for a in args):  # nothing to read
        return [list(p) for b in BasicSweeper.split_arguments(parser.parse_overrides(args), None)
                for p in b], None
    register_configs()
    register_resolvers()
    # compose with the first value of every sweep, just to read hydra.sweeper.params
    first = []
    for override in parser.parse_overrides(args):
        if override.is_sweep_override():
            first.append(f"{override.get_key_element()}={next(override.sweep_string_iterator())}")
        else:
            first.append(override.input_line)
    with initialize_config_module("depthmix.configs", version_base=None):
        cfg = compose("config", overrides=first, return_hydra_config=True)
    params = [f"{k}={v}" for k, v in (cfg.hydra.sweeper.params or {}).items()]
    batches = BasicSweeper.split_arguments(parser.parse_overrides(params + args), None)
    launcher = cfg.hydra.launcher
    world = launcher.nodes * launcher.tasks_per_node if "tasks_per_node" in launcher else None
    return [list(point) for batch in batches for point in batch], world


@functools.lru_cache(maxsize=1)
def stand_in_data() -> tuple:
    """(prefix, tokenizer) of the embedded corpus: real files to copy where a command
    names a cluster path (the preflight reads their headers and loads the tokenizer)."""
    from depthmix.config.load import compose_run
    from depthmix.data.datasets import prepare_embedded

    emb = prepare_embedded(compose_run("model=tiny"))
    return emb.prefix, emb.tokenizer


def redirect_data_paths(args: List[str], root: str) -> List[str]:
    """``/data/...`` -> ``<root>/data/...`` holding copies of the embedded corpus's files
    (the dry run checks that data prefixes and tokenizers exist and are sound)."""
    prefix, tokenizer = stand_in_data()
    out = []
    for arg in args:
        if "/data/" not in arg:
            out.append(arg)
            continue
        arg = arg.replace("/data/", f"{root}/data/")
        key, _, value = arg.partition("=")
        paths = value.strip("[]").split(",")
        is_prefix = key.endswith("prefixes")
        for path in paths:
            for suffix in ([".bin", ".idx"] if is_prefix else [""]):
                os.makedirs(os.path.dirname(path + suffix), exist_ok=True)
                source = prefix + suffix if is_prefix else tokenizer
                if not os.path.exists(path + suffix):
                    shutil.copyfile(source, path + suffix)
        out.append(arg)
    return out


def dry_run(args: List[str], world_size: Optional[int]) -> tuple:
    """(exit status, output) of ``depthmix-train <args> train.dry_run=true``, in process."""
    from depthmix.config.load import compose_run
    from depthmix.config.schema import ConfigError
    from depthmix.mixers import mixer_of
    from depthmix.planning import dry_run as dry
    from depthmix.pretrain.preflight import preflight

    try:
        run = compose_run(*args, "train.dry_run=true")
    except ConfigError as e:
        return 2, f"configuration error: {e}"
    if world_size is None:
        world_size = run.parallel.world_size or 1
    out = io.StringIO()
    try:
        preflight(run, world_size)
    except ConfigError as e:
        return 2, f"configuration error: {e}"
    dry.report(run, mixer_of(run), world_size, out)
    return 0, out.getvalue()


COMMANDS = doc_commands()


def test_the_docs_hold_the_commands_we_expect():
    """The extraction itself: the README's commands are found (setup, paper run, torchrun,
    both sweeps), and the method pages' examples."""
    readme = [c for c in COMMANDS if c.where.startswith("README.md")]
    assert len(readme) >= 5, [c.text for c in readme]
    assert any(c.text == "depthmix-train model=tiny" for c in readme)
    assert sum(c.args[:1] == ["-m"] for c in readme) >= 3
    assert any(c.program == "depthmix-sweep-summary" for c in readme)
    assert any("logger.name=" in c.text for c in readme)  # an interpolated W&B name
    assert any(c.world_size == 8 for c in readme)  # the torchrun line
    methods = {c.where.split(":")[0] for c in COMMANDS if "/methods/" in c.where}
    assert len(methods) >= 4, methods


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_doc_command_is_valid(command, tmp_path):
    if command.program == "depthmix-preprocess":
        from depthmix.cli.preprocess import build_parser

        build_parser().parse_args(command.args)  # argparse exits 2 on a wrong option
        return
    if command.program == "depthmix-sweep-summary":
        from depthmix.cli.sweep import build_parser as sweep_parser

        sweep_parser().parse_args(command.args)
        return
    args = [a for a in command.args if a not in ("-m", "--multirun")]
    assert not [a for a in args if a.startswith("-")], f"unexpected flag in {command.text}"
    args = redirect_data_paths(args, str(tmp_path))
    points, world_size = [args], command.world_size
    if len(args) < len(command.args):
        points, slurm_world = sweep_points(args)
        world_size = slurm_world or world_size
    for point in points:
        status, output = dry_run(point, world_size)
        assert status == 0, (f"{command.where}: `{command.text}` at world size "
                             f"{world_size}, point {point}: {output}")
