"""GPU run files: what ``tools/gpu_bench.py`` measured on one GPU, as JSON, and what the
planner reads from them.

A run file (``docs/gpu-runs/<date>-<device>-<commit>.json``, beside its ``.log``) holds the
machine (:data:`ENVIRONMENT_KEYS`), the state of each part (:data:`PARTS`) and one row per
measurement; :func:`validate` is the schema the table generator (``tools/gpu_tables.py``)
and the tests hold it to. Rows of a training step (``vanilla``, ``mixers`` and ``moe``) carry
the model's shape (its experts too), settings and median step time; the ``vanilla`` ones
calibrate the planner:

* :func:`fit` refits the step-time model's constants (:mod:`depthmix.planning.step_time`:
  the MFU of large GEMMs, ``GEMM_HALF_WORK``, ``STAGE_SECONDS``) to measured vanilla
  steps; ``python tools/gpu_tables.py --calibrate`` writes them, per device, into
  :data:`FIT_FILE` (package data), which :func:`fitted` reads back for the planner;
* :func:`measured` finds the measured step of a planned shape: ``depthmix-plan`` prints it
  beside its prediction. It looks in the fit file's copy of the measured rows, in the run
  files of a source checkout (``docs/gpu-runs``) and in ``$DEPTHMIX_GPU_RUNS`` (a folder).

Torch-free (the planner imports it).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from typing import Dict, Iterable, List, Optional

SCHEMA = 1
"""Version of the run-file layout; :func:`validate` refuses others."""
PARTS = ("vanilla", "mixers", "moe", "kernels", "checks")
"""The parts of a run, in the order ``tools/gpu_bench.py --part all`` runs them."""
PART_STATES = ("pending", "running", "done", "skipped")
ROW_STATES = ("ok", "error", "oom", "skipped")
MODES = ("eager", "compiled", "compiled+graphs")
"""How a training step ran: ``train.compile=false``; ``true``; ``true`` with
``train.cuda_graphs=true``."""
ENVIRONMENT_KEYS = ("device", "device_kind", "device_table", "driver", "memory_gib",
                    "peak_tflops", "torch", "cuda", "triton", "megatron_core", "transformers",
                    "fla", "python", "git_commit", "git_dirty")
TOP_KEYS = ("schema", "tool", "date", "started", "argv", "smoke", "environment", "options",
            "parts", "rows")
ROW_KEYS = ("part", "id", "status", "reason", "seconds")
STEP_KEYS = ("kind", "model", "mixer", "impl", "mode", "micro_batch", "precision", "settings",
             "params", "steps", "ms_per_step", "tokens_per_s", "flops_per_token",
             "flops_per_token_causal", "mfu", "mfu_causal", "peak_memory_gib", "profile")
MODEL_KEYS = ("preset", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "seq_length", "vocab_size")
PEER_KEYS = ("kind", "model", "peer", "mode", "micro_batch", "precision", "ms_fwd_bwd",
             "ours_ms_fwd_bwd", "profile")
KERNEL_KEYS = ("kind", "op", "case", "candidate", "baseline", "fwd_ms", "fwd_bwd_ms",
               "ratio", "peak_mib")
CHECK_KEYS = ("kind", "check", "passed", "details")
PROFILE_KEYS = ("host_ms", "kernel_ms", "categories_ms")
CATEGORIES = ("gemm", "attention", "depth_kernels", "elementwise", "optimizer",
              "communication", "memcpy", "other")
"""How a profiled step's GPU kernel time is split (``tools/gpu_bench.py``, by kernel name)."""
KINDS = {"step": STEP_KEYS, "peer": PEER_KEYS, "kernel": KERNEL_KEYS, "check": CHECK_KEYS}
"""Row kinds and the keys an ``ok`` row of each must have."""

RUNS_ENV = "DEPTHMIX_GPU_RUNS"
"""A folder of run files :func:`run_files` reads too (besides a source checkout's)."""
FIT_FILE = pathlib.Path(__file__).parent / "data" / "step_time_fit.json"
"""The planner's fitted step-time constants and the measured rows behind them."""


# ---------------------------------------------------------------------------------------
# The schema
# ---------------------------------------------------------------------------------------


def _missing(obj: dict, keys: Iterable[str], where: str) -> List[str]:
    return [f"{where}: no {k!r}" for k in keys if k not in obj]


def validate(doc) -> List[str]:
    """What is wrong with a run file (empty: nothing): the keys every run file, part and
    row must have, the kind-specific keys of every ``ok`` row, known states and modes."""
    if not isinstance(doc, dict):
        return ["a run file is a JSON object"]
    problems = _missing(doc, TOP_KEYS, "run file")
    if doc.get("schema") != SCHEMA:
        problems.append(f"run file: schema {doc.get('schema')!r}, expected {SCHEMA}")
    problems += _missing(doc.get("environment") or {}, ENVIRONMENT_KEYS, "environment")
    for part, state in (doc.get("parts") or {}).items():
        if part not in PARTS:
            problems.append(f"parts: unknown part {part!r}")
        if not isinstance(state, dict) or state.get("status") not in PART_STATES:
            problems.append(f"parts.{part}: status must be one of {PART_STATES}")
    ids = set()
    for i, row in enumerate(doc.get("rows") or []):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            problems.append(f"{where}: not an object")
            continue
        where = f"rows[{i}] ({row.get('id')})"
        problems += _missing(row, ROW_KEYS, where)
        if row.get("id") in ids:
            problems.append(f"{where}: duplicate id")
        ids.add(row.get("id"))
        if row.get("part") not in PARTS:
            problems.append(f"{where}: part {row.get('part')!r} is not one of {PARTS}")
        if row.get("status") not in ROW_STATES:
            problems.append(f"{where}: status {row.get('status')!r} is not one of {ROW_STATES}")
        if row.get("status") != "ok":
            if not row.get("reason"):
                problems.append(f"{where}: a row that is not ok needs a reason")
            continue
        kind = row.get("kind")
        if kind not in KINDS:
            problems.append(f"{where}: kind {kind!r} is not one of {tuple(KINDS)}")
            continue
        problems += _missing(row, KINDS[kind], where)
        if kind in ("step", "peer"):
            problems += _missing(row.get("model") or {}, MODEL_KEYS, f"{where}.model")
            if row.get("mode") not in MODES:
                problems.append(f"{where}: mode {row.get('mode')!r} is not one of {MODES}")
            profile = row.get("profile")
            if profile is not None:
                problems += _missing(profile, PROFILE_KEYS, f"{where}.profile")
        if kind == "step" and row.get("mixer") != "vanilla" and "extra_floor" not in row:
            problems.append(f"{where}: a mixer row needs its extra_floor")
    return problems


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def file_stem(date: str, device_kind: str, commit: str) -> str:
    """``<date>-<device>-<commit>``: a run file's name without ``.json``."""
    return f"{date}-{device_kind or 'cpu'}-{(commit or 'unknown')[:10]}"


# ---------------------------------------------------------------------------------------
# Where run files are
# ---------------------------------------------------------------------------------------


def source_dir() -> Optional[pathlib.Path]:
    """``docs/gpu-runs`` of the source checkout this package runs from, if it is one."""
    path = pathlib.Path(__file__).resolve().parents[2] / "docs" / "gpu-runs"
    return path if path.is_dir() else None


def run_files(directory=None) -> List[pathlib.Path]:
    """Run files (``*.json``) of ``directory``, else of a source checkout and of
    ``$DEPTHMIX_GPU_RUNS``, oldest first (by name: the date leads)."""
    dirs = [pathlib.Path(directory)] if directory else [source_dir(), os.environ.get(RUNS_ENV)]
    found = {p.resolve() for d in dirs if d and pathlib.Path(d).is_dir()
             for p in pathlib.Path(d).glob("*.json")}
    return sorted(found, key=lambda p: p.name)


def step_rows(doc: dict, part: Optional[str] = None) -> List[dict]:
    """The run's measured training steps (``ok`` rows of kind ``step``), each with the
    run's device, its ``device_kind`` and peak (where the row has none) and the run file's
    stem added."""
    env = doc.get("environment", {})
    stem = file_stem(doc.get("date", ""), env.get("device_kind"), env.get("git_commit"))
    return [{"device": env.get("device"), "device_kind": env.get("device_kind"),
             "device_table": env.get("device_table"), "peak_tflops": env.get("peak_tflops"),
             **row, "run_file": stem}
            for row in doc.get("rows", [])
            if row.get("status") == "ok" and row.get("kind") == "step"
            and (part is None or row.get("part") == part)]


# ---------------------------------------------------------------------------------------
# Calibration: the step-time constants from measured vanilla steps
# ---------------------------------------------------------------------------------------


def _terms(row: dict) -> tuple:
    """One GPU, one micro-batch a step: ``t = F T / P (1 / mfu) + F T / (P w) (G / mfu) + S``
    with ``F`` training FLOPs a token, ``T`` tokens a step, ``P`` the peak, ``w = b s h^2``;
    returns the coefficients of ``(1 / mfu, G / mfu, S)`` and ``t``."""
    m = row["model"]
    tokens = row["micro_batch"] * m["seq_length"]
    work = row["micro_batch"] * m["seq_length"] * m["hidden_size"] ** 2
    compute = row["flops_per_token"] * tokens / (row["peak_tflops"] * 1e12)
    return (compute, compute / work, 1.0), row["ms_per_step"] / 1e3


def fit(rows: List[dict]) -> dict:
    """Least squares (relative: each row weighted by its own step time) of the step-time
    model's constants to measured one-GPU vanilla steps of one device, all three kept
    non-negative (every subset of them is solved; the best feasible one wins). Returns
    ``mfu``, ``gemm_half_work``, ``stage_seconds``, the rows used and the largest relative
    error of the fitted model on them."""
    import itertools

    import numpy as np

    if len(rows) < 3:
        raise ValueError(f"fitting three constants needs at least 3 measured steps, got "
                         f"{len(rows)}")
    terms = [_terms(r) for r in rows]
    a = np.array([[c / t for c in coeffs] for coeffs, t in terms])
    b = np.ones(len(terms))
    best = None
    for keep in itertools.chain.from_iterable(itertools.combinations(range(3), k)
                                              for k in (3, 2, 1)):
        if 0 not in keep:
            continue  # no compute term: no MFU to speak of
        cols = a[:, list(keep)]
        scale = np.linalg.norm(cols, axis=0)  # the columns differ by ~1e11: equilibrate
        x = np.zeros(3)
        x[list(keep)] = np.linalg.lstsq(cols / scale, b, rcond=None)[0] / scale
        if (x < 0).any():
            continue
        residual = float(np.abs(a @ x - b).max())
        if best is None or residual < best[1] - 1e-12:
            best = (x, residual)
    x, residual = best
    return {"mfu": float(1 / x[0]), "gemm_half_work": float(x[1] / x[0]),
            "stage_seconds": float(x[2]), "rows": len(rows), "max_rel_error": residual}


def calibration_rows(docs: Iterable[dict], mode: str = "compiled") -> Dict[str, List[dict]]:
    """Vanilla steps of ``mode`` (``compiled``: what ``train.compile=auto`` runs on a GPU)
    from run files, by device (its name in :mod:`depthmix.planning.hardware`'s table)."""
    out: Dict[str, List[dict]] = {}
    for doc in docs:
        if doc.get("smoke"):
            continue
        for row in step_rows(doc, "vanilla"):
            if row.get("mode") == mode and row.get("peak_tflops") and row.get("device_table"):
                out.setdefault(row["device_table"], []).append(row)
    return out


def write_fit(docs: List[dict], stems: List[str], path=None, mode: str = "compiled") -> dict:
    """Fit every device's constants and write them, with the measured rows
    :func:`measured` offers the planner, to ``path`` (default :data:`FIT_FILE`)."""
    fits = {device: fit(rows) for device, rows in calibration_rows(docs, mode).items()
            if len(rows) >= 3}
    measured_rows = [_plan_key(row) for doc in docs if not doc.get("smoke")
                     for row in step_rows(doc)]
    out = {"schema": SCHEMA, "mode": mode, "run_files": stems, "devices": fits,
           "measured": measured_rows}
    path = pathlib.Path(path or FIT_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    _read_fit.cache_clear()
    return out


@functools.lru_cache(maxsize=4)
def _read_fit(path: str) -> dict:
    try:
        return load(path)
    except FileNotFoundError:
        return {}


def fitted(device_table_name: str) -> Optional[dict]:
    """The fitted constants of a device (``Device.name`` of the hardware table), or None."""
    return _read_fit(str(FIT_FILE)).get("devices", {}).get(device_table_name)


# ---------------------------------------------------------------------------------------
# Measured beside predicted (depthmix-plan)
# ---------------------------------------------------------------------------------------

SETTING_DEFAULTS = {"train.cuda_graphs": "false", "train.fused_cross_entropy": "auto",
                    "train.fused_optimizer": "auto"}
"""Fast-path options a run file's row may record; a plan matches a row when every one the
row records equals the planned run's (an option the checkout lacks counts as its default)."""


def _plan_key(row: dict) -> dict:
    """What :func:`measured` compares and prints of a step row."""
    keys = ("id", "model", "mixer", "impl", "experts_impl", "mixer_options", "mode",
            "micro_batch", "precision", "settings", "ms_per_step", "tokens_per_s", "device",
            "device_kind", "run_file")
    return {k: row.get(k) for k in keys}


EXPERT_KEYS = ("num_experts", "top_k", "ffn_hidden_size", "shared_expert_ffn_hidden_size",
               "first_dense_layers", "layer_freq")
"""What a step row records of the model's experts (``model.experts``; None: dense)."""


def experts_of(run) -> Optional[dict]:
    """The run's experts as a row's ``model.experts`` records them; None for a dense model
    (and in rows written before experts existed)."""
    e = run.model.experts
    if e is None:
        return None
    return {k: (e.expert_ffn_hidden_size(run.model) if k == "ffn_hidden_size" else getattr(e, k))
            for k in EXPERT_KEYS}


def mixer_options(run) -> dict:
    """The run's mixer options as a run file records them (JSON values; name and impl
    apart)."""
    if run.mixer is None:
        return {}
    options = {k: v for k, v in vars(run.mixer).items() if k not in ("name", "impl")}
    return json.loads(json.dumps(options, default=str))


def _run_settings(run) -> dict:
    t = run.train
    return {k: str(getattr(t, k.split(".", 1)[1], v)).lower()
            for k, v in SETTING_DEFAULTS.items()}


def _planned_mode(run) -> str:
    compiled = str(run.train.compile).lower() in ("true", "auto")  # auto: on, on a GPU
    graphs = str(getattr(run.train, "cuda_graphs", "false")).lower() == "true"
    return ("compiled+graphs" if graphs else "compiled") if compiled else "eager"


def _matches(row: dict, run, mixer, gpu: str) -> bool:
    m, model = run.model, row.get("model") or {}
    shape = {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
             "ffn_hidden_size": m.ffn_hidden_size,
             "num_attention_heads": m.num_attention_heads,
             "num_query_groups": m.num_query_groups, "kv_channels": m.kv_channels,
             "seq_length": m.seq_length, "vocab_size": m.padded_vocab_size}
    if any(model.get(k) != v for k, v in shape.items()) or m.n_loops != 1:
        return False
    if model.get("experts") != experts_of(run):  # a dense row never stands for experts
        return False
    if (row.get("device_kind") != gpu or row.get("mixer") != mixer.name
            or row.get("precision") != run.train.precision
            or row.get("mode") != _planned_mode(run)):
        return False
    if mixer.name != "vanilla":
        impl = run.mixer.impl if run.mixer.impl != "auto" else "triton"  # auto, on a GPU
        if mixer.kernels and row.get("impl") != impl:
            return False  # (without kernels both impls run the same code)
        if (row.get("mixer_options") or {}) != mixer_options(run):
            return False
    settings = _run_settings(run)
    return all(str(v).lower() == settings.get(k, str(v).lower())
               for k, v in (row.get("settings") or {}).items() if k in SETTING_DEFAULTS)


def measured(run, mixer, gpu: str, gpus: int) -> List[dict]:
    """Measured steps of ``run``'s shape and ``mixer`` (its
    :class:`~depthmix.mixers.base.Mixer`) on one GPU of kind ``gpu`` (``cluster.gpu``) at one
    micro-batch a step, newest first: from :data:`FIT_FILE` and every run file
    :func:`run_files` finds (each run file's row once). Empty unless ``gpus == 1``."""
    if gpus != 1:
        return []
    rows = {}
    for row in _read_fit(str(FIT_FILE)).get("measured", []):
        rows[(row.get("run_file"), row.get("id"))] = row
    for path in run_files():
        try:
            doc = load(path)
        except (OSError, ValueError):
            continue
        if doc.get("smoke"):
            continue
        for row in step_rows(doc):
            rows[(row["run_file"], row["id"])] = _plan_key(row)
    found = [r for r in rows.values() if r.get("micro_batch") == run.train.global_batch_size
             and _matches(r, run, mixer, gpu)]
    return sorted(found, key=lambda r: r.get("run_file") or "", reverse=True)
