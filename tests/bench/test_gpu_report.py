"""Every Triton kernel of every kernel op compiles to sm_80 and sm_90 machine code without
register spills and within its architecture's shared memory (no GPU needed: Triton's
bundled ptxas, ``depthmix/bench/gpu_report.py``). The interpreter the other kernel
tests use checks none of this, nor what only the compiler checks (constexpr control flow,
tuple-of-pointer arguments, casts).

The full lane (``-m full``; the architectures' limits are checked by default): the
compiles run in one subprocess without ``TRITON_INTERPRET`` (conftest sets it on CPU, and
under it ``triton.jit`` builds interpreted functions), one at a time (the other core has
the other xdist worker): every kernel in every config (autotune list after its prune, or
the launcher's tile choice) at every benchmark variant on both architectures, as
``tools/kernel_report.py`` does (about 300 compiles, ~10 minutes of one core on an empty
cache; a later variant can need more registers than the first: up to 16 more in the
depth_mix and moda kernels). They go through the report cache
(``gpu_report.cached_compiles``, ``~/.cache/depthmix/kernel-report``): a later run compiles
only the kernels whose Triton cache key changed (their source or a function they call, a
config, Triton, ptxas) and reads the others' ptxas figures;
``DEPTHMIX_KERNEL_REPORT_FRESH=1`` compiles everything. What the cache returns is checked
against fresh compiles each run: the attnres kernels once more, fresh, through the tool's
pool of two forked compilers (a few seconds), and a spilling config compiled fresh.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the triton package is not installed (non-x86_64 Linux)")

from depthmix.bench.gpu_report import ARCHS, Usage, check_limits


def compiled(test):
    """A test of the compiled report: the full lane, one worker, one child (the subprocess
    that compiles, one kernel at a time; its pool check forks two compilers for a moment)."""
    for mark in (pytest.mark.full, pytest.mark.multiproc(at_once=1),
                 pytest.mark.xdist_group("test_gpu_compile")):
        test = mark(test)
    return test


_SCRIPT = """
import dataclasses, glob, json, os
from depthmix.bench import gpu_report as R

only = None  # every variant
rows = R.compile_report(jobs=1, only=only)
# a config the backward's prune drops: 64 elements of a tile per thread
spilling = next(l for l in R.launches(["depth_mix"]) if l.name == "depth_mix_bwd_kernel")
spilling.kwargs.update(BLOCK_T=32, num_warps=2)
with R.fresh_compiles():
    probe = R.compile_usage(spilling, 90)
# tools/kernel_report.py's pool (two forked compilers, for a moment), compiling afresh: the
# same answers as the rows, cached or not
pool = R.compile_report(["attnres"], capabilities=(80,), jobs=2, fresh=True, only=only)
R.compile_report(["attnres"], capabilities=(80,), fresh=False, only=only)  # stored
again = R.compile_report(["attnres"], capabilities=(80,), fresh=False, only=only)  # cached
# a report stopped between a compile and storing its figures: the next compiles it again
for figures in glob.glob(os.path.join(R.report_cache_dir(), "*", R.FIGURES_FILE)):
    for meta in glob.glob(os.path.join(os.path.dirname(figures), "attnres_*_kernel.json")):
        with open(meta) as f:
            if json.load(f)["target"]["arch"] == 80:
                os.remove(figures)
recovered = R.compile_report(["attnres"], capabilities=(80,), fresh=False, only=only)
print("REPORT " + json.dumps({
    "rows": [dataclasses.asdict(r) for r in rows],
    "probe": dataclasses.asdict(probe),
    "pool": [dataclasses.asdict(r) for r in pool],
    "again": [dataclasses.asdict(r) for r in again],
    "recovered": [dataclasses.asdict(r) for r in recovered],
    "configs": sorted({(l.name, l.config) for l in R.launches()}),
}))
"""

KERNEL_SOURCES = Path(__file__).parents[2] / "depthmix" / "kernels"


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    out = json.loads(line[len("REPORT "):])
    out["rows"] = [Usage(**row) for row in out["rows"]]
    out["probe"] = Usage(**out["probe"])
    out["pool"] = [Usage(**row) for row in out["pool"]]
    for key in ("again", "recovered"):
        out[key] = [Usage(**row) for row in out[key]]
    return out


@compiled
def test_no_kernel_spills_or_exceeds_shared_memory(report):
    problems = [f"{r.kernel} [{r.variant}; {r.config}] {r.arch}: {p}"
                for r in report["rows"] for p in r.problems()]
    assert not problems, "\n".join(problems)


@compiled
def test_every_kernel_and_config_compiled_for_both_architectures(report):
    compiled = {(r.kernel, r.config, r.arch) for r in report["rows"]}
    missing = [(kernel, config, arch.name) for kernel, config in report["configs"]
               for arch in ARCHS.values() if (kernel, config, arch.name) not in compiled]
    assert not missing


@compiled
def test_every_launched_kernel_is_in_the_report(report):
    """What the launchers launch (``name[grid](...)`` in each ``triton.py``), so that a new
    kernel cannot slip past the report."""
    launched = set()
    for path in KERNEL_SOURCES.glob("*/triton.py"):
        launched |= set(re.findall(r"\b(\w+)\[(?:grid|\()", path.read_text()))
    assert launched == {r.kernel for r in report["rows"]}


@compiled
def test_a_spilling_config_is_caught(report):
    """The depth_mix backward at 64 elements per thread (pruned from the autotune list)
    spills, and the check says so."""
    probe = report["probe"]
    assert probe.spill_stores > 0 and probe.spill_loads > 0 and probe.registers == 255
    assert any("spills" in p for p in probe.problems())


def _figures(rows):
    return sorted((r.kernel, r.variant, r.config, r.registers, r.spill_stores, r.spill_loads,
                   r.stack, r.shared) for r in rows)


@compiled
def test_a_pool_of_fresh_compilers_reports_what_the_report_says(report):
    """Two forked processes compiling afresh give the figures of the report's rows, which
    came from the report cache when an earlier run had compiled the same kernels."""
    alone = [r for r in report["rows"] if r.op == "attnres" and r.arch == "sm_80"]
    assert len(report["pool"]) == len(alone) >= 2
    assert not any(r.cached for r in report["pool"])
    assert _figures(report["pool"]) == _figures(alone)


@compiled
def test_a_second_report_reads_the_cache(report):
    alone = [r for r in report["rows"] if r.op == "attnres" and r.arch == "sm_80"]
    again = report["again"]
    assert again and all(r.cached for r in again)
    assert _figures(again) == _figures(alone)
    # figures lost (a report stopped before storing them): compiled again, the same
    recovered = report["recovered"]
    assert recovered and not any(r.cached for r in recovered)
    assert _figures(recovered) == _figures(alone)


def test_limits_trip_above_the_architecture():
    sm80, sm90 = ARCHS[80], ARCHS[90]
    assert (sm80.max_shared, sm90.max_shared) == (166912, 232448)
    assert check_limits(255, 0, 0, sm80.max_shared, sm80) == []
    assert check_limits(255, 0, 0, sm90.max_shared, sm90) == []
    assert "shared memory" in check_limits(255, 0, 0, sm80.max_shared + 1, sm80)[0]
    assert check_limits(40, 0, 0, sm90.max_shared + 1, sm90)
    assert check_limits(256, 0, 0, 0, sm90)
