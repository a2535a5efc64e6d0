"""The two lanes partition the suite: what ``pytest --collect-only`` collects for the
default lane and for ``-m full`` together is every test (``-m "full or not full"``), no test
in both, neither lane empty (a lane that collects nothing would end with pytest's exit 5,
not a failure of its own). (The full lane: three collections of the whole tree.)"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collect(*args) -> set:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n0",
                           "-p", "no:cacheprovider", *args, "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (args, proc.stdout[-2000:] + proc.stderr[-2000:])
    return {line.split("@")[0] for line in proc.stdout.splitlines() if "::" in line}


@pytest.mark.full
@pytest.mark.multiproc(at_once=1)
def test_the_default_and_the_full_lane_partition_the_suite():
    default, full = _collect(), _collect("-m", "full")
    every = _collect("-m", "full or not full")
    assert default and full
    assert not default & full, sorted(default & full)[:20]
    assert default | full == every, sorted(every - default - full)[:20]
