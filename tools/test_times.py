#!/usr/bin/env python
"""Where the test suite's time goes: seconds per test file from pytest's JUnit XML, slowest
first, with its test, failure and skip counts. With two files, a before/after table.

    python -m pytest -q --junitxml=/tmp/tests.xml
    python tools/test_times.py /tmp/tests.xml                  # the table
    python tools/test_times.py /tmp/before.xml /tmp/after.xml  # before, after, change

Under xdist the seconds are each test's own (setup, call, teardown), summed per file: the
work a file costs, not the wall time of the run (the run's line prints that).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET

from tabulate import tabulate


def file_of(case) -> str:
    """tests/x/test_y.py of a <testcase> (pytest's classname is tests.x.test_y[.Class])."""
    file = case.get("file")
    if file:
        return file
    parts = case.get("classname", "").split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py" if parts else case.get("classname", "?")


def per_file(path: str) -> dict:
    """file -> (seconds, tests, failed or errored, skipped)."""
    out = collections.defaultdict(lambda: [0.0, 0, 0, 0])
    for case in ET.parse(path).iter("testcase"):
        row = out[file_of(case)]
        row[0] += float(case.get("time") or 0)
        row[1] += 1
        row[2] += any(case.find(k) is not None for k in ("failure", "error"))
        row[3] += case.find("skipped") is not None
    return dict(out)


def table(paths: list, top: int) -> str:
    runs = [per_file(p) for p in paths]
    files = sorted(set().union(*runs), key=lambda f: -max(r.get(f, [0])[0] for r in runs))
    head = ["seconds"] if len(runs) == 1 else ["before s", "after s", "change s"]
    body = []
    for f in files[:top]:
        rows = [r.get(f, [0.0, 0, 0, 0]) for r in runs]
        secs = [f"{row[0]:.1f}" for row in rows]
        if len(runs) == 2:
            secs.append(f"{rows[1][0] - rows[0][0]:+.1f}")
        last = rows[-1]
        body.append([f, *secs, str(last[1]), str(last[2]), str(last[3])])
    totals = [sum(r[0] for r in run.values()) for run in runs]
    body.append(["total", *[f"{t:.1f}" for t in totals],
                 *([f"{totals[1] - totals[0]:+.1f}"] if len(runs) == 2 else []),
                 str(sum(r[1] for r in runs[-1].values())), "", ""])
    return tabulate(body, ["file", *head, "tests", "failed", "skipped"], tablefmt="pipe",
                    colalign=("left", *["right"] * (len(head) + 3)), disable_numparse=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("xml", nargs="+", help="pytest --junitxml file(s): one, or before and after")
    p.add_argument("--top", type=int, default=40, help="rows (slowest files first)")
    args = p.parse_args(argv)
    if len(args.xml) > 2:
        p.error("give one JUnit XML file, or two (before, after)")
    print(table(args.xml, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
