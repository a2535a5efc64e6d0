"""Where evaluation results go: a JSON file, a console table, and W&B when a logger is set.

W&B: one run per evaluation (``job_type="eval"``), in the W&B group of the training run
that wrote the checkpoint (``<save_dir>/wandb_group.txt``; older save directories: the
training run's id from ``wandb_run_id.txt``) when there is one;
``eval/<dataset>/{loss,ppl,tokens}`` and ``eval/pooled/*`` are logged at the checkpoint's
step and kept in the run summary; lm-eval metrics as ``eval/<task>/<metric>``.
"""

from __future__ import annotations

import json
import os
import time
from typing import List, Optional

from tabulate import tabulate

from depthmix.evaluate.perplexity import DatasetResult, pooled


def results_dict(job, datasets: List[DatasetResult], tasks: Optional[dict],
                 seconds: float) -> dict:
    record = job.meta["record"]
    p = job.run.parallel
    out = {
        "checkpoint": os.path.abspath(job.checkpoint),
        "step": job.meta["step"],
        "model": record["model"]["name"],
        "mixer": record["mixer"]["name"],
        "precision": job.run.train.precision,
        "layout": {"world_size": job.world_size, "tp": p.tp, "pp": p.pp, "vp": p.vp or 1,
                   "dp": job.world_size // (p.tp * p.pp)},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "seconds": round(seconds, 3),
    }
    if job.datasets:
        out["seq_length"] = job.run.model.seq_length
        out["datasets"] = {r.name: {"prefix": d.prefix, **r.as_dict()}
                           for r, d in zip(datasets, job.datasets)}
        out["pooled"] = pooled(datasets).as_dict()
    if tasks is not None:
        out["tasks"] = tasks
    return out


def write_json(path: str, results: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def table(results: List[DatasetResult]) -> str:
    rows = [(r.name, f"{r.tokens:,}", f"{r.windows:,}", f"{r.loss:.4f}", f"{r.ppl:.3f}")
            for r in results]
    if len(results) > 1:
        p = pooled(results)
        rows.append(("pooled", f"{p.tokens:,}", f"{p.windows:,}", f"{p.loss:.4f}", f"{p.ppl:.3f}"))
    return tabulate(rows, ("dataset", "tokens", "windows", "loss", "ppl"), tablefmt="plain",
                    colalign=("left", "right", "right", "right", "right"),
                    disable_numparse=True)


def _flat_metrics(prefix: str, tree, out: dict) -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _flat_metrics(f"{prefix}/{k}", v, out)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        out[prefix] = tree


def log_wandb(job, results: dict) -> Optional[str]:
    """Log ``results`` to a new W&B run when ``logger.wandb`` is on; returns the console
    line naming it (offline: the ``wandb sync`` command that uploads it)."""
    lg = job.run.logger
    if not lg.wandb or lg.mode == "disabled":
        return None
    import wandb

    from depthmix.checkpoint.store import read_group, read_run_id

    save_dir = os.path.dirname(job.checkpoint)
    group = lg.group or read_group(save_dir) or read_run_id(save_dir)
    directory = lg.dir or job.run.output_dir
    os.makedirs(directory, exist_ok=True)
    name = lg.name or f"{results['model']}-{results['mixer']}-step{results['step']}-eval"
    run = wandb.init(project=lg.project, entity=lg.entity, name=name, dir=directory,
                     mode=lg.mode, group=group, job_type=lg.job_type or "eval",
                     tags=[f"model:{results['model']}", f"mixer:{results['mixer']}",
                           *lg.tags],
                     config={k: v for k, v in results.items()
                             if k not in ("datasets", "pooled", "tasks")},
                     # no banner: the caller prints the run's id (errors still raise)
                     settings=wandb.Settings(console="off", silent=True))
    metrics: dict = {}
    tasks = results.get("tasks") or {}
    for name_, tree in [*results.get("datasets", {}).items(),
                        *tasks.get("results", tasks).items()]:
        _flat_metrics(f"eval/{name_}", tree, metrics)
    if "pooled" in results:
        _flat_metrics("eval/pooled", results["pooled"], metrics)
    metrics = {k: v for k, v in metrics.items() if not k.endswith("/seconds")}
    run.log(metrics, step=int(results["step"]))
    run.summary.update(metrics)
    line = f"W&B run {run.id} ({lg.mode})"
    if lg.mode == "offline":
        from depthmix.runtime.log import short_path

        line = f"W&B (offline): wandb sync {short_path(os.path.dirname(run.dir))}"
    run.finish()
    return line
