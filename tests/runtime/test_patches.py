"""Importing depthmix changes nothing global; :func:`depthmix.runtime.install` makes the
process-global changes and :func:`depthmix.runtime.uninstall` takes every one back.

A fresh interpreter imports the third-party modules depthmix's files import at module level
first (their own import-time changes, e.g. urllib3's warning filters or torch's inductor
cache variable, are not depthmix's), takes a snapshot of ``torch.cuda``'s attributes,
``warnings.showwarning`` and ``warnings.filters``, ``os.environ``, ``sys.excepthook`` and
the torch function mode stack, imports every ``depthmix`` module, installs and uninstalls
the runtime, and compares."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import depthmix
from depthmix import runtime

PACKAGE = Path(depthmix.__file__).parent

PROBE = r"""
import importlib, json, os, pkgutil, sys, types, warnings

for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ImportError:
        pass

import torch

def snapshot():
    return {"cuda": dict(vars(torch.cuda)), "showwarning": warnings.showwarning,
            "filters": warnings.filters, "filter_items": list(warnings.filters),
            "environ": dict(os.environ), "excepthook": sys.excepthook,
            "modes": torch._C._len_torch_function_stack()}

def changes(before, after):
    out = []
    for key, value in before["cuda"].items():
        if after["cuda"].get(key, None) is not value:
            out.append(f"torch.cuda.{key} replaced")
    out += [f"torch.cuda.{key} added" for key, value in after["cuda"].items()
            if key not in before["cuda"] and not isinstance(value, types.ModuleType)]
    out += [f"{key} replaced" for key in ("showwarning", "filters", "excepthook")
            if after[key] is not before[key]]
    if after["filter_items"] != before["filter_items"]:
        out.append("warnings.filters changed")
    out += [f"os.environ[{key!r}] changed"
            for key in set(before["environ"]) | set(after["environ"])
            if before["environ"].get(key) != after["environ"].get(key)]
    if after["modes"] != before["modes"]:
        out.append("torch function mode stack changed")
    return out

before = snapshot()
import depthmix
names = [m.name for m in pkgutil.walk_packages(depthmix.__path__, "depthmix.")]
by_import = {}
for name in names:
    last = snapshot()
    importlib.import_module(name)
    found = changes(last, snapshot())
    if found:
        by_import[name] = found

from depthmix import runtime

runtime.install()
installed = changes(before, snapshot())
runtime.uninstall()
print(json.dumps({"modules": len(names), "by_import": by_import, "installed": installed,
                  "after_uninstall": changes(before, snapshot())}))
"""


def third_party_imports() -> list:
    """Modules that depthmix's files import at module level, other than depthmix's own."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return sorted(m for m in found if m.split(".")[0] != "depthmix")


@pytest.mark.multiproc(at_once=1)
def test_importing_changes_nothing_and_uninstall_restores_everything():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(third_party_imports())],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["modules"] > 100, result
    assert result["by_import"] == {}, result["by_import"]
    # the probe can see a change: install makes some (the CPU shim only without CUDA)
    assert "showwarning replaced" in result["installed"], result["installed"]
    if not torch.cuda.is_available():
        assert "torch.cuda.current_device replaced" in result["installed"]
        assert "torch function mode stack changed" in result["installed"]
    assert result["after_uninstall"] == [], result["after_uninstall"]


def test_nested_installs_undo_only_at_the_outermost():
    """The test harness holds the runtime for the session (``tests/conftest.py``); a command
    run in-process installs and uninstalls inside it and leaves it in place."""
    assert runtime.is_installed()
    patched = torch.cuda.current_device
    with runtime.installed():
        assert torch.cuda.current_device is patched
    assert runtime.is_installed() and torch.cuda.current_device is patched


def _save_results_in_a_rank(item) -> None:
    """A rank that saves and ends without uninstalling (a ``multiprocessing`` child)."""
    from depthmix.runtime.patches import ResultsQueue

    queue_ = ResultsQueue()
    queue_.put(item)
    assert os.listdir(queue_.directory)


@pytest.mark.multiproc(at_once=1)
def test_checkpoint_write_results_leave_nothing_in_the_temp_dir(tmp_path, monkeypatch):
    """Megatron's writers hand results back through a directory that exists only while it
    holds something unread: closed, or at the exit of the process that made it (a script's
    or a ``multiprocessing`` rank's), it is gone."""
    import multiprocessing
    import queue
    import tempfile

    from depthmix.runtime.patches import ResultsQueue

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    results = ResultsQueue()
    assert not os.path.exists(results.directory)  # a run that never saves makes nothing
    with pytest.raises(queue.Empty):
        results.get_nowait()
    writer = multiprocessing.get_context("fork").Process(target=results.put, args=({"ok": 1},))
    writer.start()
    writer.join()
    assert writer.exitcode == 0 and results.get_nowait() == {"ok": 1}
    results.close()
    assert os.listdir(tmp_path) == []

    rank = multiprocessing.get_context("fork").Process(target=_save_results_in_a_rank,
                                                       args=({"ok": 2},))
    rank.start()
    rank.join()
    assert rank.exitcode == 0 and os.listdir(tmp_path) == []

    script = ("from depthmix.runtime.patches import ResultsQueue\n"
              "q = ResultsQueue(); q.put(3); print(q.directory)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ, TMPDIR=str(tmp_path)), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(str(tmp_path)) and os.listdir(tmp_path) == []
