"""The points of a sweep side by side: one row per job of a multirun directory.

    depthmix-sweep-summary multirun/local/2026-11-25_20-50-00

Columns: the job number, the overrides that vary across the sweep, status and exit code,
steps, final train loss, last eval loss and perplexity, tokens/s (last log step), the
job's own wall time, its output directory. Read from each job's ``.hydra/overrides.yaml``
and the ``run_summary.json`` its closing summary writes; printed as a table and written to
``summary.md`` and ``summary.csv`` in the sweep directory. A local multirun writes it
when its last job ends (:class:`SweepSummaryCallback`, in ``configs/config.yaml``); for a
SLURM sweep, run the command once the jobs have ended.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import sys
from typing import Dict, List, Optional, Sequence

from tabulate import tabulate

from depthmix.cli.command import argument_parser, collect_statuses, command
from depthmix.config.schema import ConfigError
from depthmix.config.sweep import RESULT_FILE, swept_keys, varying
from depthmix.runtime import exit_codes
from depthmix.runtime.log import short_path

NUMBERS = ("train_loss", "eval_loss", "eval_ppl", "tokens_per_s", "wall_s")
_JOB = re.compile(r"^(\d+)_")


def job_dirs(sweep_dir: str) -> List[str]:
    """The jobs' output directories (``<n>_<overrides>`` with a ``.hydra`` record), by n."""
    found = []
    for name in os.listdir(sweep_dir):
        m = _JOB.match(name)
        if m and os.path.isfile(os.path.join(sweep_dir, name, ".hydra", "overrides.yaml")):
            found.append((int(m.group(1)), os.path.join(sweep_dir, name)))
    return [path for _, path in sorted(found)]


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def rows(sweep_dir: str, statuses: Optional[Dict[str, int]] = None) -> List[dict]:
    """One dict per job: ``job``, the varying overrides, then the run's numbers.
    ``statuses``: the exit status of each job the launcher ran, by output directory (for
    the jobs that left no ``run_summary.json``: refused at start-up)."""
    import yaml

    keys = swept_keys(sweep_dir)
    out = []
    for job in job_dirs(sweep_dir):
        with open(os.path.join(job, ".hydra", "overrides.yaml")) as f:
            overrides = [str(o) for o in yaml.safe_load(f) or []]
        row = {"job": int(_JOB.match(os.path.basename(job)).group(1)),
               **varying(overrides, keys)}
        result = _read_json(os.path.join(job, RESULT_FILE))
        if result is None:
            code = (statuses or {}).get(os.path.abspath(job))
            row.update(status="no result" if not code else "failed", exit_code=code,
                       steps=None, output_dir=os.path.abspath(job))
        else:
            row.update(status=result["status"], exit_code=result["exit_code"],
                       steps=f"{result['step']}/{result['steps']}",
                       **{k: result.get(k) for k in NUMBERS}, output_dir=result["output_dir"])
        out.append(row)
    return out


def format_cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "output_dir":
        return shlex.quote(short_path(value))
    if key == "tokens_per_s":
        return f"{value:.0f}"
    if key == "wall_s":
        return f"{value:.0f} s"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def columns(table: Sequence[dict]) -> List[str]:
    names: List[str] = []
    for row in table:
        names += [k for k in row if k not in names]
    return names


def text_table(table: Sequence[dict]) -> str:
    """Aligned columns for the console."""
    names = columns(table)
    return tabulate([[format_cell(k, row.get(k)) for k in names] for row in table], names,
                    tablefmt="plain", disable_numparse=True)


def markdown_table(table: Sequence[dict]) -> str:
    names = columns(table)
    return tabulate([[format_cell(k, row.get(k)).replace("|", "\\|") for k in names]
                     for row in table], names, tablefmt="github", disable_numparse=True)


def write(sweep_dir: str, statuses: Optional[Dict[str, int]] = None) -> str:
    """Write ``summary.md`` and ``summary.csv`` into the sweep directory; returns the
    console table."""
    table = rows(sweep_dir, statuses)
    names = columns(table)
    with open(os.path.join(sweep_dir, "summary.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(table)
    with open(os.path.join(sweep_dir, "summary.md"), "w") as f:
        f.write(f"# Sweep {os.path.basename(os.path.abspath(sweep_dir))}\n\n"
                f"{markdown_table(table)}\n")
    where = shlex.quote(short_path(os.path.join(sweep_dir, "summary.md")))
    return f"{text_table(table)}\nsweep summary: {where} (and summary.csv)"


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # Hydra is a dependency; this keeps the module importable without it
    _HydraCallback = object


class SweepSummaryCallback(_HydraCallback):
    """Hydra callback: after the last job of a multirun, the table on the console and the
    files in the sweep directory; a local multirun then exits with its worst job's status."""

    def __init__(self):
        self.statuses: Dict[str, int] = {}
        self.local = False  # the jobs run in this process, one after another

    def on_multirun_start(self, config, **kwargs) -> None:
        self.local = "BasicLauncher" in str(config.hydra.launcher.get("_target_", ""))
        collect_statuses(self.local)  # a job's non-zero status comes here, not sys.exit

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus

        out = os.path.abspath(job_return.hydra_cfg.hydra.runtime.output_dir)
        if job_return.status == JobStatus.FAILED:
            self.statuses[out] = exit_codes.CRASH
        elif isinstance(job_return.return_value, int):
            self.statuses[out] = job_return.return_value
        if self.local:  # kept current: a crashed point ends the sweep before its end
            write(str(config.hydra.sweep.dir), self.statuses)

    def on_multirun_end(self, config, **kwargs) -> None:
        collect_statuses(False)
        sweep_dir = str(config.hydra.sweep.dir)
        if os.path.isdir(sweep_dir) and job_dirs(sweep_dir):
            print(write(sweep_dir, self.statuses), flush=True)
        worst = max(self.statuses.values(), default=exit_codes.OK)
        if worst:
            sys.exit(worst)


def build_parser():
    parser = argument_parser(
        "depthmix-sweep-summary",
        "Compare the points of a multirun: one row per job (the overrides that vary, status, "
        "steps, final train loss, last eval loss/ppl, tokens/s, wall time, output "
        "directory), printed and written to summary.md and summary.csv in the sweep "
        "directory. A local multirun writes it by itself when it ends; run this for a SLURM "
        "sweep once its jobs have ended. Takes a second.",
        "Example:\n  depthmix-sweep-summary multirun/local/2026-11-25_20-50-00")
    parser.add_argument("sweep_dir", help="the multirun's directory (holds <n>_<overrides>/)")
    return parser


@command
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isdir(args.sweep_dir):
        raise ConfigError(f"sweep_dir: {args.sweep_dir} is not a directory")
    if not job_dirs(args.sweep_dir):
        raise ConfigError(f"sweep_dir: {args.sweep_dir} holds no multirun job "
                          "(<n>_<overrides>/.hydra/overrides.yaml)")
    print(write(args.sweep_dir))
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
