"""Run a depthmix command (``depthmix-train``, ``-eval``, ``-generate``, ...) as a real
process in a clean environment: the one helper every test that starts a CLI uses."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
# pytest may itself run under torchrun or a launch script: each child names its own run
LAUNCHER_KEYS = ("DEPTHMIX_RUN_KEY", "TORCHELASTIC_RUN_ID")


def clean_env(**extra) -> dict:
    """This process's environment for a child: the repository importable, one thread, W&B
    quiet, no launcher's run key; ``extra`` on top (a value of None removes the variable)."""
    env = dict(os.environ)
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    for key in LAUNCHER_KEYS:
        env.pop(key, None)
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


def command(name: str, installed: bool = False) -> list:
    """``depthmix-<x>``: ``python -m depthmix.cli.<module>``, or with ``installed`` the
    console script a user runs (beside this Python)."""
    if installed:
        return [os.path.join(os.path.dirname(PYTHON), name)]
    module = {"depthmix-import": "importer"}.get(name, name.removeprefix("depthmix-"))
    return [PYTHON, "-m", f"depthmix.cli.{module}"]


def run(name: str, args, cwd=None, env=None, timeout: float = 300, check: bool = True,
        installed: bool = False) -> subprocess.CompletedProcess:
    """Run ``name`` with ``args`` (output captured); with ``check``, a non-zero exit fails
    the test showing the end of the output."""
    proc = subprocess.run([*command(name, installed), *args], cwd=cwd,
                          env=env if env is not None else clean_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
