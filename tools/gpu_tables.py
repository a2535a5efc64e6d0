#!/usr/bin/env python
"""The GPU tables of docs/benchmarks.md, generated from the run files in docs/gpu-runs/
(``tools/gpu_bench.py``'s JSON), and the planner's constants fitted to them.

    python tools/gpu_tables.py --add $FILES_AT/*.json   # copy run files (+ logs) in, regenerate
    python tools/gpu_tables.py                 # regenerate every table in docs/benchmarks.md
    python tools/gpu_tables.py --check         # exit 1 if a table and its run file disagree
    python tools/gpu_tables.py --calibrate     # refit the planner's step-time constants

Each table sits between ``<!-- gpu-table:<run>/<table> -->`` and ``<!-- /gpu-table -->``
(``<run>``: the run file's name without ``.json``); only what is between the markers is
rewritten. A run file without tables in the document gets a section of them (newest
first) after the ``<!-- gpu-runs -->`` line. Tables: ``environment``, ``vanilla``,
``mixers``, ``moe``, ``peers``, ``profile``, ``kernels``, ``checks`` (those the run has rows
for).

``--calibrate`` fits the step-time model's constants (MFU of large GEMMs,
``GEMM_HALF_WORK``, ``STAGE_SECONDS``) per device to the compiled vanilla rows of every run
file and writes them, with the measured rows ``depthmix-plan`` shows beside its
predictions, to ``depthmix/planning/data/step_time_fit.json`` (commit it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from typing import Dict, List, Optional, Tuple

from tabulate import tabulate

from depthmix.planning import gpu_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "benchmarks.md")
RUNS = os.path.join(REPO, "docs", "gpu-runs")
ANCHOR = "<!-- gpu-runs -->"
BLOCK = re.compile(r"<!-- gpu-table:(?P<name>[^ ]+) -->\n(?P<body>.*?)<!-- /gpu-table -->",
                   re.S)
TABLES = ("environment", "vanilla", "mixers", "moe", "peers", "profile", "kernels", "checks")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 naming every table that disagrees")
    p.add_argument("--calibrate", action="store_true",
                   help="refit the planner's step-time constants to the run files")
    p.add_argument("--add", nargs="+", default=[], metavar="RUN_FILE",
                   help="copy these run files (and their .log) into the runs folder first")
    p.add_argument("--doc", default=DOC)
    p.add_argument("--runs", default=RUNS, help="the folder of run files")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
# Tables of one run
# ---------------------------------------------------------------------------------------


def _f(x, digits: int = 1, suffix: str = "") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:,.{digits}f}{suffix}"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def _table(header: List[str], rows: List[List[str]]) -> str:
    cells = [[str(c).replace("|", "/") for c in r] for r in rows]
    return tabulate(cells, header, tablefmt="github", disable_numparse=True) + "\n"


def _not_ok(row: dict) -> str:
    return f"{row['status']}: {row.get('reason') or ''}".strip()


def _where(row: dict) -> str:
    m = row.get("model") or {}
    return (f"{m.get('preset')} L{m.get('num_layers')} h{m.get('hidden_size')} "
            f"s{m.get('seq_length')}")


def environment_table(doc: dict) -> str:
    e = doc["environment"]
    commit = (e.get("git_commit") or "unknown")[:10] + (" (dirty)" if e.get("git_dirty") else "")
    parts = ", ".join(f"{p} {s['status']} ({_f(s.get('seconds'), 0)} s)"
                      for p, s in doc.get("parts", {}).items())
    rows = [["device", f"{e['device']} ({_f(e.get('memory_gib'))} GiB, driver "
                       f"{e.get('driver') or '–'})"],
            ["software", f"torch {e['torch']} (CUDA {e.get('cuda') or '–'}), Triton "
                         f"{e['triton']}, megatron-core {e.get('megatron_core') or '–'}, "
                         f"transformers {e.get('transformers') or '–'}, fla-core "
                         f"{e.get('fla') or '–'}, Python {e.get('python')}"],
            ["commit", commit], ["date", doc["date"]], ["parts", parts],
            ["fast paths", ", ".join(f"{k} {'yes' if v else 'absent'}"
                                     for k, v in doc.get("options", {}).items())]]
    return _table(["", ""], rows)


def vanilla_table(doc: dict) -> str:
    rows = []
    for r in doc["rows"]:
        if r["part"] != "vanilla":
            continue
        name = r["id"].split("/", 1)[1]
        if r["status"] != "ok":
            rows.append([name, "", "", "", "", "", _not_ok(r)])
            continue
        rows.append([name, _f(r["ms_per_step"]), _f(r["tokens_per_s"], 0),
                     f"{_pct(r.get('mfu'))} ({_pct(r.get('mfu_causal'))})",
                     _f(r.get("peak_memory_gib")), _f(r.get("first_step_s")), ""])
    return _table(["shape / micro-batch / mode", "ms/step", "tokens/s", "MFU (causal half)",
                   "peak GiB", "first step s", "note"], rows)


def mixers_table(doc: dict) -> str:
    rows = []
    vanilla = {r["mode"]: r["ms_per_step"] for r in gpu_runs.step_rows(doc, "mixers")
               if r["mixer"] == "vanilla"}
    for r in doc["rows"]:
        if r["part"] != "mixers" or r["id"].startswith("mixers/peer/"):
            continue
        _, mixer, impl, mode = r["id"].split("/", 3)
        if r["status"] != "ok":
            rows.append([mixer, impl, mode, "", "", "", "", "", _not_ok(r)])
            continue
        base = vanilla.get(r["mode"])
        floor = (r.get("extra_floor") or {}).get("ms")
        verdict = ""
        if "within_floor_budget" in r:
            verdict = ("pass" if r["within_floor_budget"] else "fail") + \
                f" (≤ {_f(r['budget_ms'])})"
        rows.append([mixer, impl if mixer != "vanilla" else "", mode, _f(r["ms_per_step"]),
                     _f(r["ms_per_step"] / base, 2) if base else "–",
                     _f(r["tokens_per_s"], 0), _pct(r.get("mfu")),
                     _f(floor, 2) if floor is not None else "", verdict])
    return _table(["mixer", "impl", "mode", "ms/step", "× vanilla", "tokens/s", "MFU",
                   "extra floor ms", "step ≤ vanilla + 1.5 × floor"], rows)


def moe_table(doc: dict) -> str:
    """The ``moe`` part: each row against vanilla over the same experts and, for grouped
    experts, against the same mixer over sequential ones."""
    ok = {(r["mixer"], r.get("experts_impl")): r["ms_per_step"]
          for r in gpu_runs.step_rows(doc, "moe")}
    rows = []
    for r in doc["rows"]:
        if r["part"] != "moe":
            continue
        _, mixer, experts, mode = r["id"].split("/", 3)
        if r["status"] != "ok":
            rows.append([mixer, experts, "", mode, "", "", "", "", "", "", _not_ok(r)])
            continue
        ms = r["ms_per_step"]
        base = ok.get(("vanilla", experts)) if mixer != "vanilla" else None
        sequential = ok.get((mixer, "sequential")) if experts == "grouped" else None
        floor = (r.get("extra_floor") or {}).get("ms")
        verdict = ""
        if "within_floor_budget" in r:
            verdict = ("pass" if r["within_floor_budget"] else "fail") + \
                f" (≤ {_f(r['budget_ms'])})"
        rows.append([mixer, experts, r.get("impl") or "", mode, _f(ms),
                     _f(ms / base, 2) if base else "–",
                     _f(ms / sequential, 2) if sequential else "–",
                     _f(r["tokens_per_s"], 0), _pct(r.get("mfu")),
                     _f(r.get("peak_memory_gib")), verdict])
    return _table(["mixer", "experts", "impl", "mode", "ms/step", "× vanilla",
                   "× sequential", "tokens/s", "MFU", "peak GiB",
                   "step ≤ vanilla + 1.5 × floor"], rows)


def peers_table(doc: dict) -> str:
    rows = []
    for r in doc["rows"]:
        if not r["id"].startswith("mixers/peer/"):
            continue
        if r["status"] != "ok":
            rows.append([r["id"].rsplit("/", 1)[1], "", "", "", _not_ok(r)])
            continue
        rows.append([r["mode"], _f(r["ours_ms_fwd_bwd"]), _f(r["ms_fwd_bwd"]),
                     _f(r["ms_fwd_bwd"] / r["ours_ms_fwd_bwd"], 2), _where(r)])
    return _table(["mode", "depthmix vanilla f+b ms", "HF Qwen3 (SDPA) f+b ms",
                   "HF / ours", "shape"], rows)


def profile_table(doc: dict) -> str:
    rows = []
    for r in doc["rows"]:
        p = r.get("profile") if r["status"] == "ok" else None
        if not p:
            continue
        c = p["categories_ms"]
        rows.append([r["id"], _f(p["host_ms"]), _f(p["kernel_ms"]),
                     *[_f(c.get(k)) for k in gpu_runs.CATEGORIES]])
    return _table(["row (one step)", "host ms", "kernel ms", *gpu_runs.CATEGORIES], rows)


def kernels_table(doc: dict) -> str:
    rows = []
    for r in doc["rows"]:
        if r["part"] != "kernels":
            continue
        case, candidate = r["id"].split("/", 1)[1].rsplit("/", 1)
        if r["status"] != "ok":
            rows.append([case, candidate, "", "", "", "", "", _not_ok(r)])
            continue
        rows.append([case, candidate, _f(r["fwd_ms"], 3), _f(r["fwd_bwd_ms"], 3),
                     _f(r.get("ratio"), 2), _f(r.get("floor_ms"), 3), _f(r.get("peak_mib")),
                     ""])
    return _table(["case", "candidate", "fwd ms", "f+b ms", "f+b / baseline",
                   "floor f+b ms", "peak MiB", "note"], rows)


def _check_details(r: dict) -> str:
    """A check is a ``gpu``-marked test: its failure message, else the test."""
    d = r.get("details") or {}
    message = " ".join((d.get("message") or "").split())
    return message[:200] if message and not r["passed"] else f"`{d.get('test', '')}`"


def checks_table(doc: dict) -> str:
    rows = []
    for r in doc["rows"]:
        if r["part"] != "checks":
            continue
        name = r["id"].split("/", 1)[1]
        if r["status"] != "ok":
            rows.append([name, "–", _not_ok(r)])
            continue
        rows.append([name, "pass" if r["passed"] else "**FAIL**", _check_details(r)])
    return _table(["check", "result", "details"], rows)


BUILDERS = {"environment": environment_table, "vanilla": vanilla_table,
            "mixers": mixers_table, "moe": moe_table, "peers": peers_table,
            "profile": profile_table,
            "kernels": kernels_table, "checks": checks_table}


def tables(doc: dict) -> Dict[str, str]:
    """The run's tables by name (only those it has rows for)."""
    parts = {r["part"] for r in doc["rows"]}
    has = {"environment": True, "vanilla": "vanilla" in parts,
           "mixers": any(r["part"] == "mixers" and not r["id"].startswith("mixers/peer/")
                         for r in doc["rows"]),
           "moe": "moe" in parts,
           "peers": any(r["id"].startswith("mixers/peer/") for r in doc["rows"]),
           "profile": any(r.get("profile") for r in doc["rows"]),
           "kernels": "kernels" in parts, "checks": "checks" in parts}
    return {name: BUILDERS[name](doc) for name in TABLES if has[name]}


# ---------------------------------------------------------------------------------------
# The document
# ---------------------------------------------------------------------------------------


def stem_of(doc: dict) -> str:
    e = doc["environment"]
    return gpu_runs.file_stem(doc["date"], e.get("device_kind"), e.get("git_commit"))


def section(stem: str, doc: dict) -> str:
    """A new run's section: a heading, then each table between its markers."""
    e = doc["environment"]
    out = [f"### {e['device']}, {doc['date']} (`docs/gpu-runs/{stem}.json`)\n"]
    for name, body in tables(doc).items():
        out.append(f"<!-- gpu-table:{stem}/{name} -->\n{body}<!-- /gpu-table -->\n")
    return "\n".join(out)


def render(text: str, runs: Dict[str, dict]) -> Tuple[str, List[str]]:
    """``text`` with every table regenerated from ``runs`` (stem -> run file) and a section
    added for each run without tables; and what cannot be rendered (a table whose run
    file or table is missing, a run without the anchor to place it)."""
    problems: List[str] = []
    generated = {stem: tables(doc) for stem, doc in runs.items()}

    def replace(match):
        name = match.group("name")
        stem, _, table = name.rpartition("/")
        if stem not in generated:
            problems.append(f"table {name}: no run file {stem}.json")
            return match.group(0)
        if table not in generated[stem]:
            problems.append(f"table {name}: the run file has no such table")
            return match.group(0)
        return f"<!-- gpu-table:{name} -->\n{generated[stem][table]}<!-- /gpu-table -->"

    text = BLOCK.sub(replace, text)
    placed = {m.group("name").rpartition("/")[0] for m in BLOCK.finditer(text)}
    new = [stem for stem in sorted(runs, reverse=True) if stem not in placed]
    if new:
        if ANCHOR not in text:
            problems.append(f"no {ANCHOR} line to put the tables of {', '.join(new)} after")
        else:
            sections = "\n".join(section(stem, runs[stem]) for stem in new)
            text = text.replace(ANCHOR, f"{ANCHOR}\n\n{sections.rstrip()}", 1)
    return text, problems


def disagreements(text: str, runs: Dict[str, dict]) -> List[str]:
    """Every table of ``text`` that differs from its run file, every run file without
    tables and every table without a run file (empty: the document is up to date)."""
    rendered, problems = render(text, runs)
    if rendered == text:
        return problems
    old = {m.group("name"): m.group("body") for m in BLOCK.finditer(text)}
    new = {m.group("name"): m.group("body") for m in BLOCK.finditer(rendered)}
    for name in sorted(new):
        if name not in old:
            problems.append(f"table {name}: missing from the document")
        elif old[name] != new[name]:
            problems.append(f"table {name}: differs from its run file")
    return problems or ["the document differs from what the run files generate"]


def load_runs(directory: str) -> Dict[str, dict]:
    """Valid run files of ``directory`` by stem; a file that fails the schema stops here."""
    runs = {}
    for path in gpu_runs.run_files(directory):
        doc = gpu_runs.load(path)
        problems = gpu_runs.validate(doc)
        if problems:
            raise SystemExit(f"{path}: not a valid run file: " + "; ".join(problems[:5]))
        runs[path.stem] = doc
    return runs


def add(files: List[str], directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for path in files:
        doc = gpu_runs.load(path)
        problems = gpu_runs.validate(doc)
        if problems:
            raise SystemExit(f"{path}: not a valid run file: " + "; ".join(problems[:5]))
        stem = stem_of(doc)
        target = os.path.join(directory, stem + ".json")
        log = os.path.splitext(path)[0] + ".log"
        if os.path.exists(target):  # a later call of the same run: its rows win
            doc = merge(gpu_runs.load(target), doc)
            with open(target, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
            if os.path.exists(log):
                with open(os.path.join(directory, stem + ".log"), "a") as f:
                    f.write(open(log).read())
            print(f"merged into {stem}.json")
            continue
        shutil.copyfile(path, target)
        if os.path.exists(log):
            shutil.copyfile(log, os.path.join(directory, stem + ".log"))
        print(f"added {stem}.json")


def merge(old: dict, new: dict) -> dict:
    """Two calls of one run (same device and commit): ``new``'s rows replace ``old``'s of
    the same id unless those were ok and the new ones not; parts and argv combined."""
    rows = {r["id"]: r for r in old["rows"]}
    for r in new["rows"]:
        if r["status"] == "ok" or rows.get(r["id"], {}).get("status") != "ok":
            rows[r["id"]] = r
    argv = old["argv"] + [a for a in new["argv"] if a not in old["argv"]]
    return {**old, "argv": argv, "parts": {**old["parts"], **new["parts"]},
            "rows": list(rows.values())}


def calibrate(runs: Dict[str, dict], path: Optional[str] = None) -> dict:
    fit = gpu_runs.write_fit(list(runs.values()), sorted(runs), path)
    for device, c in fit["devices"].items():
        print(f"{device}: MFU {c['mfu']:.3f}, GEMM_HALF_WORK {c['gemm_half_work']:.3g}, "
              f"STAGE_SECONDS {c['stage_seconds'] * 1e3:.3f} ms from {c['rows']} rows "
              f"(largest error {c['max_rel_error']:.1%})")
    if not fit["devices"]:
        print("no device has 3 compiled vanilla rows: nothing fitted (the defaults stay)")
    print(f"{len(fit['measured'])} measured rows for depthmix-plan; wrote "
          f"{path or gpu_runs.FIT_FILE}")
    return fit


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.add:
        add(args.add, args.runs)
    runs = load_runs(args.runs)
    if args.calibrate:
        calibrate(runs)
        return 0
    text = open(args.doc).read()
    if args.check:
        problems = disagreements(text, runs)
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    rendered, problems = render(text, runs)
    for p in problems:
        print(p, file=sys.stderr)
    if rendered != text:
        with open(args.doc, "w") as f:
            f.write(rendered)
        print(f"updated {args.doc} from {len(runs)} run file(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
