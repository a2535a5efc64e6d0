#!/usr/bin/env python
"""GPU readiness without a GPU: compile report and roofline floors of the Triton kernels.

Compiles every Triton kernel of the four ops (forward and backward, every autotune config
or launcher tile choice, at the benchmark shapes) for sm_80 and sm_90 with Triton's
bundled ptxas, and prints per kernel and config the registers per thread, spills and
shared memory against each architecture's limit (``depthmix/bench/gpu_report.py``);
then the roofline floor of each op at each full benchmark shape on an H100 and an H200
(``depthmix/bench/roofline.py``). Markdown tables, as in ``docs/benchmarks.md``. Exits 1
when a kernel spills or asks for more shared memory than its architecture has.

    python tools/kernel_report.py                      # everything (about 2 min on 2 cores)
    python tools/kernel_report.py --first-variants     # each kernel and config once (~50 s)
    python tools/kernel_report.py --fresh              # compile all, not reading the cache
    python tools/kernel_report.py --ops mhc --archs 90 --json mhc.json
    python tools/kernel_report.py --roofline           # floors only (no compiling)

A kernel whose Triton cache key is unchanged since an earlier report (same source and
callees, config, Triton and ptxas) is read from the report cache, not compiled again
(``gpu_report.report_cache_dir()``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict
from typing import Dict, List, Sequence

from tabulate import tabulate

# Triton must not interpret: the kernels are compiled (a test run sets TRITON_INTERPRET=1)
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, said aloud

from depthmix import runtime  # noqa: E402

runtime.install()  # held back: Megatron's import-time notices (the bench modules import it)

from depthmix import kernels  # noqa: E402
from depthmix.bench import gpu_report, roofline  # noqa: E402
from depthmix.planning.hardware import H100, H200  # noqa: E402


def _kib(n: float) -> str:
    return f"{n / 1024:.2f}".rstrip("0").rstrip(".")


def _span(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _variants(labels: Sequence[str]) -> str:
    """``G1 hd128 value``, ``G8 hd128 value`` -> ``G1/G8 hd128 value`` (each word's
    values in order of appearance)."""
    words = [label.split() for label in dict.fromkeys(labels)]
    if len({len(w) for w in words}) != 1:
        return ", ".join(" ".join(w) for w in words)
    return " ".join("/".join(dict.fromkeys(column)) for column in zip(*words))


def compile_table(rows: List[gpu_report.Usage]) -> str:
    """One line per kernel and config; several benchmark variants of a config share the
    line (ranges over them)."""
    groups: Dict[tuple, Dict[str, List[gpu_report.Usage]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        groups[(row.op, row.kernel, row.config)][row.arch].append(row)
    archs = [a for a in gpu_report.ARCHS.values() if any(r.arch == a.name for r in rows)]
    head = ["op", "kernel", "config", "variants"]
    for a in archs:
        head += [f"regs {a.name}", f"smem KiB {a.name} (of {_kib(a.max_shared)})"]
    head += ["spills B (st/ld)"]
    lines = []
    for (op, kernel, config), by_arch in groups.items():
        every = [r for rs in by_arch.values() for r in rs]
        cells = [op, f"`{kernel}`", config, _variants([r.variant for r in every])]
        for a in archs:
            arch_rows = by_arch.get(a.name, [])
            cells += [_span([r.registers for r in arch_rows]) if arch_rows else "-",
                      _kib(max(r.shared for r in arch_rows)) if arch_rows else "-"]
        cells.append(f"{max(r.spill_stores for r in every)}/{max(r.spill_loads for r in every)}")
        lines.append(cells)
    return tabulate(lines, head, tablefmt="github", disable_numparse=True)


def roofline_table(work: List[roofline.Work]) -> str:
    """One line per op and shape: forward and backward bytes, FLOPs, floors."""
    pairs: Dict[tuple, Dict[str, roofline.Work]] = defaultdict(dict)
    for w in work:
        pairs[(w.op, w.case)][w.direction] = w
    head = ["op", "shape", "MB fwd / bwd", "GFLOP fwd / bwd", "H100 µs fwd / bwd",
            "bound fwd / bwd", "H100 µs f+b", "H200 µs f+b"]
    lines = []
    for (op, case), by_dir in pairs.items():
        fwd, bwd = by_dir["fwd"], by_dir["bwd"]
        (f100, fb), (b100, bb) = fwd.floor(H100), bwd.floor(H100)
        h200 = fwd.floor(H200)[0] + bwd.floor(H200)[0]
        lines.append([
            op, case, f"{fwd.bytes / 1e6:.0f} / {bwd.bytes / 1e6:.0f}",
            f"{fwd.flops / 1e9:.1f} / {bwd.flops / 1e9:.1f}",
            f"{f100 * 1e6:.1f} / {b100 * 1e6:.1f}", f"{fb} / {bb}",
            f"{(f100 + b100) * 1e6:.1f}", f"{h200 * 1e6:.1f}"])
    return tabulate(lines, head, tablefmt="github", disable_numparse=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(kernels.ops()), help="comma list (default: all)")
    parser.add_argument("--archs", default="80,90", help="compute capabilities")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--first-variants", action="store_true",
                        help="each kernel and config at its first benchmark variant only")
    parser.add_argument("--fresh", action="store_true",
                        help="compile every kernel, reading nothing from the report cache")
    parser.add_argument("--roofline", action="store_true", help="the floors only")
    parser.add_argument("--json", help="also write the compile rows here")
    args = parser.parse_args(argv)
    ops = [op for op in args.ops.split(",") if op]

    problems = []
    if not args.roofline:
        start = time.perf_counter()
        only = gpu_report.first_variants(ops) if args.first_variants else None
        rows = gpu_report.compile_report(ops, [int(a) for a in args.archs.split(",")],
                                         args.jobs, only, fresh=args.fresh or None)
        versions = ", ".join(f"{k} {v}" for k, v in gpu_report.tool_versions().items())
        cached = sum(r.cached for r in rows)
        print(f"{len(rows) - cached} kernels compiled, {cached} read from the report cache, "
              f"in {time.perf_counter() - start:.0f} s ({args.jobs} processes; {versions})\n")
        print(compile_table(rows) + "\n")
        problems = [f"{r.kernel} [{r.variant}; {r.config}] {r.arch}: {p}"
                    for r in rows for p in r.problems()]
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    work = roofline.all_work(ops)
    print(roofline_table(work))
    for line in problems:
        print("PROBLEM", line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
