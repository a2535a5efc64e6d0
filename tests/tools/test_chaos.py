"""tools/chaos.py with 3 faults on one rank: the interrupted and relaunched job ends with the
uninterrupted run's losses (every step, every attempt), final weights and final evaluation,
and no process outlives an attempt. The full lane: one process's kill -9 leaving nothing
behind is ``tests/checkpoint/test_save_guard.py``, bit-exact resume
``tests/checkpoint/test_resume.py``."""

import json
import os
import subprocess
import sys

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "chaos.py")

pytestmark = [pytest.mark.multiproc, pytest.mark.full]


def _chaos(tmp_path, *args):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, TOOL, "--json", str(out), "--dir",
                           str(tmp_path / "work"), *args],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=900)
    return proc, json.loads(out.read_text())


def test_three_faults_end_where_an_uninterrupted_run_ends(tmp_path):
    proc, report = _chaos(tmp_path, "--faults", "3", "--nproc", "1", "parallel=single")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] and report["survivors"] == 0 and report["finished"]
    assert report["losses_equal"] and report["final_weights_equal"]
    assert report["final_eval_equal"] and report["steps_compared"] == 12
    assert report["attempts"] >= 3 and report["faults_hit"] >= 1
