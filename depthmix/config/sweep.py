"""Where a Hydra job sits in its sweep: the sweep directory, a short sweep id, and the
overrides that vary across the sweep's points (read back from the ``multirun.yaml`` Hydra
writes into the sweep directory before it launches the jobs), without torch.

W&B display names and groups (:mod:`depthmix.pretrain.callbacks.wandb`) and the sweep
summary (:mod:`depthmix.cli.sweep`) are made of these."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

MULTIRUN_FILE = "multirun.yaml"
RESULT_FILE = "run_summary.json"
"""``<output_dir>/run_summary.json``: a run's closing numbers (written by
:class:`depthmix.pretrain.callbacks.summary.RunSummary`, one row of the sweep summary)."""


@dataclass
class SweepPoint:
    directory: str
    """The sweep directory (``multirun/<key or run.name>``)."""
    job_overrides: List[str] = field(default_factory=list)
    """This point's command-line overrides."""

    @property
    def sweep_id(self) -> str:
        return sweep_id(self.directory)

    @property
    def group(self) -> str:
        return sweep_name(self.directory)

    @property
    def varying(self) -> Dict[str, str]:
        return varying(self.job_overrides, swept_keys(self.directory))


def sweep_id(directory: str) -> str:
    """Six hex digits of the sweep directory's absolute path: a re-run of the same sweep
    command (a new directory) gets new names, a resumed sweep (``run.name``) keeps them."""
    return hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:6]


def sweep_name(directory: str, cwd: Optional[str] = None) -> str:
    """The sweep directory below ``multirun/`` (``local/2026-11-25_20-50-00``, a
    ``run.name``), else its own name."""
    root = os.path.join(os.path.abspath(cwd or os.getcwd()), "multirun")
    target = os.path.abspath(directory)
    if os.path.commonpath([root, target]) == root and target != root:
        return os.path.relpath(target, root)
    return os.path.basename(target)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def swept_keys(directory: str) -> List[str]:
    """The keys given several values in the sweep's command line or its ``sweep=`` preset
    (``hydra.sweeper.params``), in command-line order; [] without a ``multirun.yaml``."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = os.path.join(directory, MULTIRUN_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        hydra = (yaml.safe_load(f) or {}).get("hydra") or {}
    params = (hydra.get("sweeper") or {}).get("params") or {}
    task = [*(f"{k}={v}" for k, v in params.items()),
            *((hydra.get("overrides") or {}).get("task") or [])]
    keys = []
    for o in OverridesParser.create().parse_overrides(task):
        if o.is_sweep_override() and o.key_or_group not in keys:
            keys.append(o.key_or_group)
    return keys


def varying(job_overrides: Sequence[str], keys: Sequence[str]) -> Dict[str, str]:
    """``{key: value}`` of this job's overrides whose key is swept, in ``keys``' order."""
    mine = {_key(o): o.split("=", 1)[1] for o in job_overrides if "=" in o}
    return {k: mine[k] for k in keys if k in mine}


def current() -> Optional[SweepPoint]:
    """This Hydra job's place in its multirun; None outside a multirun job."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return SweepPoint(str(hc.sweep.dir), [str(o) for o in hc.overrides.task])
