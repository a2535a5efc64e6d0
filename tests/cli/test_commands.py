"""What every command shares (``depthmix.cli.command``): the exit statuses of
``depthmix.runtime.exit_codes`` in every ``--help``, and a configuration error as one line
and status 2."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from depthmix.cli.command import command
from depthmix.config.schema import ConfigError
from depthmix.runtime import exit_codes

# [project.scripts] of pyproject.toml: command -> module
COMMANDS = {"depthmix-train": "train", "depthmix-eval": "eval", "depthmix-generate": "generate",
            "depthmix-export": "export", "depthmix-import": "importer",
            "depthmix-plan": "plan", "depthmix-overheads": "overheads",
            "depthmix-preprocess": "preprocess"}
HYDRA = ("train", "eval")  # their main reads sys.argv, as Hydra does


def test_every_console_script_is_a_cli_main():
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    scripts = dict(re.findall(r'^(depthmix-[a-z]+) = "depthmix\.cli\.([a-z]+):main"$', text,
                              re.M))
    assert scripts == COMMANDS


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_help_lists_the_exit_statuses(name, monkeypatch, capsys):
    module = importlib.import_module(f"depthmix.cli.{COMMANDS[name]}")
    if COMMANDS[name] in HYDRA:
        monkeypatch.setattr(sys, "argv", [name, "--help"])
        status = module.main()
    else:
        try:
            status = module.main(["--help"])
        except SystemExit as e:  # argparse
            status = e.code
    assert status == exit_codes.OK
    help_text = " ".join(capsys.readouterr().out.split())
    assert exit_codes.HELP in help_text, help_text[-600:]


def test_the_help_names_every_exit_status():
    for code in (exit_codes.OK, exit_codes.CRASH, exit_codes.CONFIG_ERROR, exit_codes.DIVERGED,
                 exit_codes.INTERRUPTED):
        assert f" {code} " in exit_codes.HELP, code


def test_a_configuration_error_is_one_line_and_status_2(capsys):
    @command(input_errors=(FileNotFoundError,), prog="depthmix-x")
    def main(what):
        if what == "config":
            raise ConfigError("train.lr=-1 must be > 0")
        if what == "input":
            raise FileNotFoundError("nope.jsonl")
        if what == "crash":
            raise RuntimeError("a bug")
        return None if what == "ok" else exit_codes.DIVERGED

    assert main("config") == exit_codes.CONFIG_ERROR
    assert capsys.readouterr().err == "configuration error: train.lr=-1 must be > 0\n"
    assert main("input") == exit_codes.CRASH
    assert capsys.readouterr().err == "depthmix-x: error: nope.jsonl\n"
    assert main("ok") == exit_codes.OK and main("diverged") == exit_codes.DIVERGED
    with pytest.raises(RuntimeError):  # anything else: a traceback, status 1
        main("crash")
