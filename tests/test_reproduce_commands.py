"""Every ``depthmix-train`` command of docs/reproduce.md composes and passes the dry run at
its stated ``parallel.world_size``, every multirun point included (data paths replaced by the
embedded corpus: the doc's paths exist only on a cluster)."""

import io
import itertools
import re
import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from depthmix.config.load import compose_run
from depthmix.pretrain import dry_run

DOC = Path(__file__).resolve().parents[1] / "docs" / "reproduce.md"
DATA_KEYS = ("data=", "data.prefixes=", "data.tokenizer=", "launcher=")


def commands():
    text = DOC.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line for block in blocks for line in block.splitlines()
            if line.startswith("depthmix-train")]


def sweep_params(overrides):
    """The sweep file's ``hydra.sweeper.params`` as overrides."""
    from hydra import compose, initialize_config_module

    from depthmix.config.store import register_configs

    register_configs()
    with initialize_config_module("depthmix.configs", version_base=None):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    params = cfg.hydra.sweeper.get("params") or {}
    return [f"{k}={v}" for k, v in params.items()]


def points(line):
    """(world size, overrides) of every job the command launches."""
    args = shlex.split(line)[1:]
    multirun = "-m" in args
    args = [a for a in args if a != "-m" and not a.startswith(DATA_KEYS)]
    world = next(int(a.split("=")[1]) for a in args if a.startswith("parallel.world_size="))
    if not multirun:
        return [(world, args)]
    parser = OverridesParser.create()
    given = parser.parse_overrides(args)
    fixed = [o.input_line for o in given if not o.is_sweep_override()]
    keys = {o.get_key_element().lstrip("+") for o in given}
    swept = [p for p in sweep_params(fixed) if p.split("=")[0].lstrip("+") not in keys]
    parsed = given + parser.parse_overrides(swept)
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if o.is_sweep_override() else [o.input_line] for o in parsed]
    return [(world, list(p)) for p in itertools.product(*axes)]


def test_the_page_has_commands():
    assert len(commands()) >= 8


@pytest.mark.parametrize("line", commands(), ids=lambda line: line[15:70])
def test_command_dry_runs(line):
    jobs = points(line)
    assert jobs
    for world, overrides in jobs:
        run = compose_run(*overrides)
        out = io.StringIO()
        assert dry_run.main(run, world_size=world, out=out) == 0, (overrides, out.getvalue())
