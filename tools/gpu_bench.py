#!/usr/bin/env python
"""The GPU numbers, in one call: what a session lent a GPU runs first.

One fixed matrix, run in parts, vanilla first (one call may be all the GPU time there is),
written to one run file (``<date>-<device>-<commit>.json``, see
:mod:`depthmix.planning.gpu_runs` for its schema) and its log, under ``--out`` (default
``$OUT`` when set, else ``gpu-run/``). The JSON is rewritten after every row, so a killed
run keeps what finished; each row runs in a ``try`` that records its error (out of memory
too) and moves on. A time budget (``--budget-s``, 8 minutes) is shared out over the parts
(vanilla until 38 % of it, mixers 64 %, moe 72 %, kernels 84 %, checks the rest; what a
part leaves passes on); a row that would not end in time is recorded as skipped, with the
command that runs it. The parts:

* ``vanilla``: training steps of the ``1p5b`` preset (seq 2048, 48 layers) and the ``3b``
  widths (the most layers of 48/36/24/12 the memory model fits), micro-batch 1/2/4 and 8
  (where the memory model fits it), each ``eager`` (``train.compile=false``),
  ``compiled`` (``true``) and ``compiled+graphs`` (and ``train.cuda_graphs=true``); one
  ``1p5b`` row with ``train.fused_cross_entropy=false train.fused_optimizer=false``. A
  fast-path option this checkout lacks is recorded, and rows that need it are skipped.
* ``mixers``: every mixer of the registry (:func:`registered_mixers`) x ``mixer.impl``
  torch/triton (triton only where the mixer has kernels) x eager/compiled at vanilla's best
  setting (the ``1p5b`` row with the most tokens/s: its micro-batch and fast paths) at
  ``--mixer-layers`` (12: a compiled non-uniform stack compiles one body per layer) with a
  vanilla row of each mode beside them, each mixer row carrying its extra roofline floor
  (:func:`depthmix.bench.roofline.step_extra_floor`) and whether
  ``step <= vanilla + 1.5 x extra floor``; Hugging Face's Qwen3 (SDPA) eager and compiled
  (regional, as ours) against our vanilla model, forward + backward at the same shape.
* ``moe``: training steps over experts, the ``1p5b_moe`` preset (16 experts of width 1024,
  4 a token) at ``--mixer-layers``, eager, at vanilla's best micro-batch: vanilla with
  grouped-GEMM experts (``model.moe.experts_impl=grouped``, ``torch._grouped_mm``) and with
  sequential ones (Megatron's ``SequentialMLP``), then Block AttnRes and mHC (the mixers
  Kimi's and DeepSeek's MoE models carry) grouped, then sequential (:data:`MOE_ROWS`); each
  mixer row with its extra floor against vanilla over the same experts.
* ``kernels``: ``moda_attention`` forward + backward at T 4K/16K/64K G 4 D 48 and the MoDA
  paper's rows, ours against SDPA and, where fla-core is installed, its ``parallel_attn``,
  each with its roofline floor.
* ``checks``: the GPU-only correctness checks, the tests of ``tests/`` marked ``gpu``
  (``pytest -m gpu`` in one process, a row each; pytest must be installed): background
  saves resumed bit for bit with a writer forked from a process whose CUDA is initialised
  that stays off the GPU (``tests/checkpoint/test_async_save.py``), the compiled Triton
  kernels' losses against ``mixer.impl=torch`` for every mixer with kernels
  (``tests/kernels/test_stack.py``), and whatever else carries the marker.

Every training row is built through the trainer's own path (``compose_run`` overrides and
``Trainer``, synthetic data), reports the median ms/step, tokens/s, MFU by the trainer's
FLOP count (:mod:`depthmix.planning.flops`, attention over the whole score square) and by
the causal half, peak memory, and for one step under ``torch.profiler`` the host time and
the GPU kernel time by category (GEMM, attention, depth kernels, elementwise, optimizer,
communication, memcpy, other: by kernel name).

On the GPU machine (Python 3.12, no megatron-core or hydra there: ``.whl`` carries them,
see ``../shared/tools/device-wheels.sh`` and docs/benchmarks.md, "The next GPU session"),
with ``carry [".whl"]``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \\
    PYTHONUNBUFFERED=1 python3 tools/gpu_bench.py --part all

Here: ``python tools/gpu_bench.py --smoke`` (tiny shapes, 1-2 steps, every mixer eager,
the MoE rows at ``tiny_moe``; what ``tests/tools/test_gpu_bench.py`` runs). Then
``tools/gpu_tables.py`` turns the run file into the tables of docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, NamedTuple, Optional

from depthmix.cli.command import ArgumentParser, DefaultsFormatter

PARTS = ("vanilla", "mixers", "moe", "kernels", "checks")
SHARES = {"vanilla": 0.38, "mixers": 0.64, "moe": 0.72, "kernels": 0.84, "checks": 1.0}
"""Where each part's time ends, as a fraction of ``--budget-s`` (cumulative)."""


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                       formatter_class=DefaultsFormatter)
    p.add_argument("--part", default="all", choices=["all", *PARTS])
    p.add_argument("--out", default=None,
                   help="folder of the run file and its log (default $OUT, else gpu-run)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, 1-2 steps, every mixer eager (the CPU test)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="seconds for the whole call (0: no limit)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (4; smoke 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (2; smoke 1); compiling happens here")
    p.add_argument("--mixer-layers", type=int, default=12,
                   help="layers of the mixers part (at the 1p5b widths)")
    p.add_argument("--rows", default=None, metavar="REGEX",
                   help="run only the rows whose id matches (e.g. 'mixers/.*/compiled')")
    p.add_argument("--resume", default=None, metavar="RUN_FILE",
                   help="go on from this run file of the same device and commit (carried "
                        "in): its ok rows are kept, not run again, and its vanilla rows "
                        "give the mixers their setting")
    p.add_argument("--git-file", default=".whl/GIT_COMMIT",
                   help="the commit and dirty flag, where git cannot tell (the GPU machine)")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help or a wrong option: answered before torch is imported

import torch  # noqa: E402

from depthmix.planning import gpu_runs  # noqa: E402

GIB = 2 ** 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_TRITON = ("depth_attn", "ddl")
"""The mixers whose Triton rows the smoke run has (Triton's CPU interpreter is slow); it
runs every mixer's torch rows."""
FAST_PATHS = {"train.compile": "auto", "train.cuda_graphs": "false",
              "train.fused_cross_entropy": "auto", "train.fused_optimizer": "auto"}
"""The trainer's fast-path switches and the value that needs no override."""
MOE_ROWS = (("vanilla", "grouped"), ("vanilla", "sequential"), ("attnres_block", "grouped"),
            ("mhc", "grouped"), ("attnres_block", "sequential"), ("mhc", "sequential"))
"""The ``moe`` part's ``(mixer, model.moe.experts_impl)``, in the order they run: vanilla
over grouped and sequential experts first, then the mixers users pair with experts (Block
AttnRes in Kimi's models, mHC in DeepSeek's) grouped, then sequential."""
SMOKE_MOE_ROWS = (("vanilla", "grouped"), ("vanilla", "sequential"),
                  ("attnres_block", "grouped"), ("mhc", "sequential"))
"""The smoke run's: each mixer and each experts implementation once."""
MODE_SETTINGS = {
    "eager": {"train.compile": "false", "train.cuda_graphs": "false"},
    "compiled": {"train.compile": "true", "train.cuda_graphs": "false"},
    "compiled+graphs": {"train.compile": "true", "train.cuda_graphs": "true"},
}
UNFUSED = {"train.fused_cross_entropy": "false", "train.fused_optimizer": "false"}
ESTIMATE_S = {"eager": 12.0, "compiled": 35.0, "compiled+graphs": 20.0, "peer": 30.0,
              "kernel": 8.0, "moe": 15.0}
"""A row's expected seconds before one of its kind has run (then: the longest seen)."""
PROFILE_RULES = (
    ("communication", r"nccl|all_?reduce|reduce_?scatter|all_?gather"),
    ("optimizer", r"multi_tensor|adam|l2norm|foreach"),
    ("attention", r"flash|fmha|attention|sdpa|_moda_|cudnn"),
    ("depth_kernels", r"depth_mix|attnres|mhc_|sinkhorn"),
    ("gemm", r"gemm|cutlass|cublas|xmma|nvjet|wgmma|matmul|gemv|splitk"),
    ("memcpy", r"memcpy|memset"),
    ("elementwise", r"elementwise|vectorized|reduce|triton_|softmax|norm|cat_|copy|fill|"
                    r"index|embedding|cross_entropy|nll|unrolled|scatter|gather"),
)


# ---------------------------------------------------------------------------------------
# The run file
# ---------------------------------------------------------------------------------------


class RunFile:
    """The JSON document, its log, and the time budget; every change is written at once."""

    def __init__(self, args, out: str, env: dict, options: dict):
        date = datetime.date.today().isoformat()
        stem = gpu_runs.file_stem(date, env["device_kind"], env["git_commit"])
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, stem + ".json")
        self.log_path = os.path.join(out, stem + ".log")
        previous = args.resume or (self.path if os.path.exists(self.path) else None)
        if previous:  # another part of the same run: append
            self.doc = gpu_runs.load(previous)
            theirs = self.doc["environment"]
            if (theirs.get("device_kind"), theirs.get("git_commit")) != (
                    env["device_kind"], env["git_commit"]):
                raise SystemExit(f"--resume {previous}: a run of {theirs.get('device')} at "
                                 f"{theirs.get('git_commit')}, not of this device and commit")
            self.doc["argv"].append(sys.argv[1:])
        else:
            self.doc = {"schema": gpu_runs.SCHEMA, "tool": "tools/gpu_bench.py", "date": date,
                        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                            timespec="seconds"),
                        "argv": [sys.argv[1:]], "smoke": args.smoke, "environment": env,
                        "options": options, "parts": {}, "rows": []}
        self.rows_re = re.compile(args.rows) if args.rows else None
        self.began = time.monotonic()
        self.budget = args.budget_s
        self.deadline = float("inf")
        self.smoke = args.smoke
        self.seen: Dict[str, float] = {}
        self.write()

    def log(self, message: str) -> None:
        print(message, flush=True)
        with open(self.log_path, "a") as f:
            f.write(message + "\n")

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=_json_default)
            f.write("\n")
        os.replace(tmp, self.path)

    def start_part(self, part: str) -> None:
        self.deadline = (self.began + SHARES[part] * self.budget if self.budget
                         else float("inf"))
        self.doc["parts"][part] = {"status": "running", "seconds": 0.0}
        self._part_began = time.monotonic()
        self.write()
        self.log(f"== part {part} (until {self.deadline - self.began:.0f} s of the budget)")

    def end_part(self, part: str, status: str = "done", reason: Optional[str] = None) -> None:
        state = self.doc["parts"][part]
        state.update(status=status, seconds=round(time.monotonic() - self._part_began, 1))
        if reason:
            state["reason"] = reason
        self.write()

    def wanted(self, row_id: str) -> bool:
        return self.rows_re is None or bool(self.rows_re.search(row_id))

    def row(self, part: str, row_id: str, estimate_key: str, fn: Callable[[], dict],
            release: bool = True) -> Optional[dict]:
        """Run ``fn`` for one row (unless filtered out or out of time) and record it;
        ``release``: free the model-parallel state and memory after it (not for a row
        measured inside another, whose trainer is still in use)."""
        if not self.wanted(row_id):
            return None
        existing = [r for r in self.doc["rows"] if r["id"] == row_id]
        if existing and existing[0]["status"] == "ok":
            return existing[0]
        self.doc["rows"] = [r for r in self.doc["rows"] if r["id"] != row_id]
        estimate = 0.0 if self.smoke else self.seen.get(estimate_key,
                                                        ESTIMATE_S[estimate_key])
        began = time.monotonic()
        if began + estimate > self.deadline:
            row = {"part": part, "id": row_id, "status": "skipped",
                   "reason": f"time budget: ~{estimate:.0f} s needed, "
                             f"{max(0.0, self.deadline - began):.0f} s left for this part; "
                             f"run it with --part {part} --rows '{re.escape(row_id)}'"}
        else:
            self.log(f"-- {row_id}")
            try:
                row = {"part": part, "id": row_id, "status": "ok", "reason": None, **fn()}
            except Skip as e:
                row = {"part": part, "id": row_id, "status": "skipped", "reason": str(e)}
            except Exception as e:  # noqa: BLE001 -- the row records it, the run goes on
                oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)
                row = {"part": part, "id": row_id, "status": "oom" if oom else "error",
                       "reason": f"{type(e).__name__}: {str(e)[:500]}"}
                with open(self.log_path, "a") as f:
                    traceback.print_exc(file=f)
                e.__traceback__ = None
            finally:
                if release:
                    _release()
            if row["status"] != "skipped":
                took = time.monotonic() - began
                self.seen[estimate_key] = max(self.seen.get(estimate_key, 0.0), took)
        return self.record(part, row_id, row, began)

    def record(self, part: str, row_id: str, fields: dict, began: float) -> dict:
        """Add the row ``row_id`` (replacing an earlier one) that began at ``began``."""
        row = {"part": part, "id": row_id, "reason": None, **fields}
        row["seconds"] = round(time.monotonic() - began, 2)
        self.doc["rows"] = [r for r in self.doc["rows"] if r["id"] != row_id]
        self.doc["rows"].append(row)
        self.write()
        self.log(f"   {row['status']}" + (f": {row['reason']}" if row.get("reason") else "")
                 + _summary(row))
        return row


class Skip(Exception):
    """A row that cannot run here, with the reason."""


def _json_default(obj):
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def _summary(row: dict) -> str:
    if row.get("status") != "ok":
        return ""
    if "ms_per_step" in row:
        mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") else ""
        return f"  {row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s{mfu}"
    if "fwd_bwd_ms" in row:
        return f"  f+b {row['fwd_bwd_ms']:.3f} ms ({row.get('ratio') or float('nan'):.2f}x)"
    if "ms_fwd_bwd" in row:
        return f"  f+b {row['ms_fwd_bwd']:.1f} ms (ours {row['ours_ms_fwd_bwd']:.1f})"
    if "passed" in row:
        return f"  passed={row['passed']}"
    return ""


def _release() -> None:
    from depthmix.pretrain.parallelize import destroy_model_parallel

    try:
        destroy_model_parallel()
    except Exception:  # noqa: BLE001 -- nothing was initialised
        pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------


def _version(dist: str) -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(git_file: str) -> tuple:
    """``(commit, dirty)`` of this checkout, from git or, where the tree came without
    ``.git`` (the GPU machine), from ``git_file`` (``<commit> [dirty]``, written by the
    preparation command in docs/benchmarks.md)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True, timeout=10, cwd=REPO).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=30,
                                    cwd=REPO).stdout.strip())
        return commit, dirty
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        words = open(os.path.join(REPO, git_file)).read().split()
        return words[0], len(words) > 1 and words[1] == "dirty"
    except (OSError, IndexError):
        return "unknown", None


def environment(git_file: str) -> dict:
    from depthmix.planning import hardware
    from depthmix.planning.planner import GPU_KINDS
    import platform

    import triton

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "CPU"
    table = hardware.device_named(name) if cuda else None
    kind = next((k for k, v in GPU_KINDS.items() if table and v.name == table.name), None)
    driver = None
    if cuda:
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            driver = None
    commit, dirty = _git(git_file)
    return {
        "device": name, "device_kind": kind, "device_table": table.name if table else None,
        "driver": driver,
        "memory_gib": (torch.cuda.get_device_properties(0).total_memory / GIB if cuda
                       else None),
        "peak_tflops": table.tflops.get("bf16") if table else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "megatron_core": _version("megatron-core"), "transformers": _version("transformers"),
        "fla": _version("fla-core"), "python": platform.python_version(),
        "git_commit": commit, "git_dirty": dirty,
    }


def train_options() -> dict:
    """Which fast-path switches this checkout's ``TrainConfig`` has."""
    from depthmix.config.schema import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: k.split(".", 1)[1] in names for k in FAST_PATHS}


# ---------------------------------------------------------------------------------------
# One training step, measured
# ---------------------------------------------------------------------------------------


class Shape(NamedTuple):
    preset: str
    layers: int
    seq: int
    micro_batch: int
    precision: str
    model_options: tuple = ()

    def overrides(self) -> List[str]:
        return [f"model={self.preset}", f"model.num_layers={self.layers}",
                f"model.seq_length={self.seq}", f"train.micro_batch_size={self.micro_batch}",
                f"train.global_batch_size={self.micro_batch}",
                f"train.precision={self.precision}", *self.model_options]


def settings_overrides(settings: dict, options: dict) -> List[str]:
    """Overrides for ``settings``; :class:`Skip` when one needs a switch this checkout
    lacks (a switch at its no-override value is left out)."""
    out = []
    for key, value in settings.items():
        if options.get(key):
            out.append(f"{key}={value}")
        elif value != FAST_PATHS[key]:
            raise Skip(f"{key} does not exist in this checkout (another change adds it)")
    return out


def compose(shape: Shape, mixer: str, impl: Optional[str], settings: dict, options: dict,
            extra=()):
    from depthmix.config.load import compose_run

    overrides = [*shape.overrides(), f"mixer={mixer}", "logger=none",
                 *settings_overrides(settings, options), *extra]
    if impl:
        overrides.append(f"mixer.impl={impl}")
    return compose_run(*overrides), overrides


def fits(run, env: dict) -> Optional[str]:
    """None, or why the memory model says ``run`` does not fit this GPU."""
    from depthmix.mixers import mixer_of
    from depthmix.planning import memory

    if not env.get("memory_gib"):
        return None
    need = max(r.total_bytes for r in memory.estimate(run, mixer_of(run), 1)) / GIB
    budget = env["memory_gib"] - memory.RESERVE_GIB
    if need > budget:
        return f"does not fit: the memory model needs {need:.1f} GiB of {budget:.1f} GiB"
    return None


def profile_call(call: Callable[[], object]) -> dict:
    """One call under ``torch.profiler`` after one profiled warm-up call: host time (the
    operators' own CPU time), GPU kernel time and that time by category (by kernel name,
    :data:`PROFILE_RULES`)."""
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for _ in range(2):
            call()
            sync()
            prof.step()
    host = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
    categories = {c: 0.0 for c in gpu_runs.CATEGORIES}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        cat = next((c for c, rule in PROFILE_RULES if re.search(rule, name)), "other")
        categories[cat] += e.self_device_time_total / 1e3
    return {"host_ms": round(host, 3), "kernel_ms": round(sum(categories.values()), 3),
            "categories_ms": {k: round(v, 3) for k, v in categories.items()}}


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values())}


def measure_step(run, overrides: List[str], mode: str, settings: dict, steps: int,
                 warmup: int, profile: bool, after: Optional[Callable] = None) -> dict:
    """Build a trainer for ``run`` (synthetic data), step it ``warmup`` + ``steps`` times and
    describe the timed steps as a run-file row; ``after(trainer)`` runs before it goes."""
    from depthmix.planning.flops import device_peak_tflops, flops_per_token
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if mode == "compiled+graphs":  # CUDA-graph trees warm up, record, then replay
        warmup = max(warmup, 3)
    trainer = Trainer(run, data=SyntheticData(run), callbacks=[])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = _dynamo_counts()
    times, losses, first = [], [], None
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        result = trainer.train_one_step()
        sync()
        elapsed = time.perf_counter() - t0
        first = elapsed if first is None else first
        losses.append(result.loss)
        if i >= warmup:
            times.append(elapsed)
    dynamo = {k: v - before[k] for k, v in _dynamo_counts().items()}
    peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
    t = statistics.median(times)
    m = run.model
    tokens = run.train.global_batch_size * m.seq_length
    f = flops_per_token(run, trainer.mixer, trainer.config)
    causal = f["train"] - 3 * f["attention"] / 2
    peak_tflops = device_peak_tflops(run, torch.cuda.get_device_name() if cuda else None)
    tflops = f["train"] * tokens / t / 1e12
    mixer = run.mixer.name if run.mixer is not None else "vanilla"
    row = {
        "kind": "step",
        "model": {"preset": m.name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                  "ffn_hidden_size": m.ffn_hidden_size,
                  "num_attention_heads": m.num_attention_heads,
                  "num_query_groups": m.num_query_groups, "kv_channels": m.kv_channels,
                  "seq_length": m.seq_length, "vocab_size": m.padded_vocab_size,
                  "experts": gpu_runs.experts_of(run)},
        "mixer": mixer, "impl": run.mixer.impl if mixer != "vanilla" else None,
        "experts_impl": m.experts.experts_impl if m.experts is not None else None,
        "mixer_options": gpu_runs.mixer_options(run) if mixer != "vanilla" else {},
        "mode": mode, "micro_batch": run.train.micro_batch_size,
        "precision": run.train.precision, "settings": settings, "overrides": overrides,
        "params": sum(p.numel() for chunk in trainer.model for p in chunk.parameters()),
        "steps": steps, "warmup": warmup, "ms_per_step": t * 1e3,
        "ms_all": [round(x * 1e3, 3) for x in times], "first_step_s": round(first, 3),
        "losses": losses, "tokens_per_s": tokens / t, "flops_per_token": f["train"],
        "flops_per_token_causal": causal, "peak_tflops": peak_tflops, "tflops": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "mfu_causal": causal * tokens / t / 1e12 / peak_tflops if peak_tflops else None,
        "peak_memory_gib": peak, "dynamo": dynamo, "profile": None,
    }
    if not all(x == x and abs(x) != float("inf") for x in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    if profile:
        try:
            row["profile"] = profile_call(trainer.train_one_step)
        except Exception as e:  # noqa: BLE001 -- e.g. the profiler and CUDA graphs
            row["profile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if after is not None:
        after(trainer)
    del trainer
    return row


# ---------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------


def registered_mixers() -> List[str]:
    """Every mixer of the registry but vanilla (a mixer folder on ``DEPTHMIX_MIXER_PATH``
    too): the mixers of both matrices."""
    from depthmix.mixers import available

    return [name for name in available() if name != "vanilla"]


class Matrix:
    """The fixed matrix of a GPU run, or of the smoke run."""

    def __init__(self, args, env: dict):
        self.smoke = args.smoke
        self.steps = args.steps or (1 if args.smoke else 4)
        self.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
        self.precision = "fp32" if args.smoke else "bf16"
        if args.smoke:
            self.presets = [("tiny", [4])]
            self.seq = 64
            self.micro_batches = [1, 2]  # compiled rows left out: inductor takes a minute here
            self.vanilla_modes = {1: ["eager", "compiled+graphs"], 2: ["eager"]}
            self.mixers = registered_mixers()
            self.mixer_modes = ["eager"]
            self.mixer_shape = ("tiny", 4)
            self.moe_shape, self.moe_rows = ("tiny_moe", 4), SMOKE_MOE_ROWS
        else:
            self.presets = [("1p5b", [48]), ("3b", [48, 36, 24, 12])]
            self.seq = 2048
            self.micro_batches = [1, 2, 4, 8]
            modes = ["eager", "compiled", "compiled+graphs"]
            self.vanilla_modes = {mb: modes for mb in self.micro_batches}
            self.mixers = registered_mixers()
            self.mixer_modes = ["eager", "compiled"]
            self.mixer_shape = ("1p5b", args.mixer_layers)
            self.moe_shape, self.moe_rows = ("1p5b_moe", args.mixer_layers), MOE_ROWS
        self.model_options = ()


def run_vanilla(rf: RunFile, mx: Matrix, env: dict, options: dict) -> None:
    cuda = torch.cuda.is_available()
    for preset, depths in mx.presets:
        layers = depths[0]
        if len(depths) > 1:  # the most layers that fit at micro-batch 1
            for depth in depths:
                run, _ = compose(Shape(preset, depth, mx.seq, 1, mx.precision), "vanilla",
                                 None, MODE_SETTINGS["eager"], options)
                layers = depth
                if fits(run, env) is None:
                    break
        for mode in ("eager", "compiled", "compiled+graphs"):
            for mb in mx.micro_batches:
                if mode not in mx.vanilla_modes.get(mb, []):
                    continue
                shape = Shape(preset, layers, mx.seq, mb, mx.precision, mx.model_options)
                row_id = f"vanilla/{preset}-L{layers}/mb{mb}/{mode}"

                def measure(shape=shape, mode=mode):
                    if mode == "compiled+graphs" and not cuda:
                        raise Skip("CUDA graphs need a GPU")
                    settings = dict(MODE_SETTINGS[mode])
                    run, overrides = compose(shape, "vanilla", None, settings, options)
                    why = fits(run, env)
                    if why:
                        raise Skip(why)
                    return measure_step(run, overrides, mode, settings, mx.steps, mx.warmup,
                                        profile=shape.micro_batch == mx.micro_batches[
                                            min(1, len(mx.micro_batches) - 1)])

                rf.row("vanilla", row_id, mode, measure)
    if mx.smoke:
        return
    best = best_vanilla(rf.doc)
    mb = best["micro_batch"] if best else 2
    shape = Shape("1p5b", 48, mx.seq, mb, mx.precision)

    def unfused():
        settings = {**MODE_SETTINGS["compiled"], **UNFUSED}
        run, overrides = compose(shape, "vanilla", None, settings, options)
        return measure_step(run, overrides, "compiled", settings, mx.steps, mx.warmup, False)

    rf.row("vanilla", f"vanilla/1p5b-L48/mb{mb}/compiled/unfused", "compiled", unfused)


def best_vanilla(doc: dict, preset: Optional[str] = None) -> Optional[dict]:
    """The vanilla row with the most tokens/s (of ``preset``'s rows, default the first
    preset measured), its fast paths at their defaults."""
    rows = [r for r in gpu_runs.step_rows(doc, "vanilla") if not r["id"].endswith("/unfused")]
    if preset is None and rows:
        preset = rows[0]["model"]["preset"]
    rows = [r for r in rows if r["model"]["preset"] == preset]
    return max(rows, key=lambda r: r["tokens_per_s"]) if rows else None


def mixer_rows(mx: Matrix, modes: List[str]) -> List[tuple]:
    """``(mixer, impl, mode)`` of the mixers part, in the order they run: every mixer x
    torch/triton x ``modes`` (the smoke run's Triton rows: :data:`SMOKE_TRITON` only); on
    a GPU the eager rows of every mixer first, then the compiled ones."""
    order = [(m, i, mode) for mode in modes for i in ("torch", "triton") for m in mx.mixers
             if i == "torch" or not mx.smoke or m in SMOKE_TRITON]
    if not mx.smoke:
        order = ([o for o in order if o[2] == "eager"]
                 + [o for o in order if o[2] != "eager" and o[1] == "triton"]
                 + [o for o in order if o[2] != "eager" and o[1] == "torch"])
    return order


def run_mixers(rf: RunFile, mx: Matrix, env: dict, options: dict):
    from depthmix.bench.roofline import step_extra_floor
    from depthmix.mixers import get_mixer
    from depthmix.planning import hardware

    best = best_vanilla(rf.doc)
    mb = best["micro_batch"] if best else (1 if mx.smoke else 2)
    graphs = bool(best) and best["mode"] == "compiled+graphs"
    rf.doc["parts"]["mixers"]["setting"] = {
        "micro_batch": mb, "compiled_mode": "compiled+graphs" if graphs else "compiled",
        "from": best["id"] if best else "no vanilla row: the default micro-batch"}
    preset, layers = mx.mixer_shape
    shape = Shape(preset, layers, mx.seq, mb, mx.precision, mx.model_options)
    device = hardware.device_named(env["device"]) if env.get("device_kind") else None
    floor_device = device or hardware.H100  # CPU: the arithmetic only, on the H100's numbers
    modes = ["compiled+graphs" if (m == "compiled" and graphs) else m for m in mx.mixer_modes]
    vanilla_ms: Dict[str, float] = {}

    def settings_of(mode):
        return dict(MODE_SETTINGS[mode])

    def step(mixer, impl, mode, after=None):
        def measure():
            if mode == "compiled+graphs" and not torch.cuda.is_available():
                raise Skip("CUDA graphs need a GPU")
            settings = settings_of(mode)
            run, overrides = compose(shape, mixer, impl, settings, options)
            row = measure_step(run, overrides, mode, settings, mx.steps, mx.warmup,
                               profile=True, after=after)
            if mixer == "vanilla":
                vanilla_ms[mode] = row["ms_per_step"]
                return row
            floor = step_extra_floor(run, floor_device)
            row["extra_floor"] = {**floor.as_dict(), "device_measured": device is not None}
            base = vanilla_ms.get(mode)
            row["vanilla_ms"] = base
            if base is not None:
                row["budget_ms"] = base + 1.5 * floor.seconds * 1e3
                row["within_floor_budget"] = row["ms_per_step"] <= row["budget_ms"]
            return row
        return measure

    # vanilla beside the mixers, each mode, and Hugging Face's Qwen3 against it (eager and
    # compiled: timed outside the trainer, layers under CUDA graphs would need its step marks)
    for mode in dict.fromkeys([*mx.mixer_modes, *modes]):
        after = (lambda trainer, mode=mode: peers(rf, mx, trainer, mode)) if mode in (
            "eager", "compiled") else None
        rf.row("mixers", f"mixers/vanilla/torch/{mode}", mode, step("vanilla", None, mode,
                                                                    after))
    for mixer, impl, mode in mixer_rows(mx, modes):
        row_id = f"mixers/{mixer}/{impl}/{mode}"
        if impl == "triton" and not get_mixer(mixer).kernels:
            if rf.wanted(row_id):
                rf.doc["rows"] = [r for r in rf.doc["rows"] if r["id"] != row_id]
                rf.doc["rows"].append({"part": "mixers", "id": row_id, "status": "skipped",
                                       "reason": "no Triton kernels: the torch row is it",
                                       "seconds": 0.0})
                rf.write()
            continue
        rf.row("mixers", row_id, mode, step(mixer, impl, mode))


def peers(rf: RunFile, mx: Matrix, trainer, mode: str) -> None:
    """Hugging Face's Qwen3 (SDPA) forward + backward beside our vanilla model's, at the
    trainer's shape; compiled like ours (each decoder layer) in the compiled modes."""
    from depthmix.megatron_ext.model import unwrap
    from depthmix.bench.peers import compile_hf_layers, hf_qwen3, time_forward_backward

    def measure():
        run = trainer.run
        hf = hf_qwen3(run, trainer.config.kv_channels)
        if hf is None:
            raise Skip("transformers is not installed")
        name, model, loss_fn = hf
        ours = unwrap(trainer.model[0])
        device = next(ours.parameters()).device
        model.to(device)
        if mode != "eager":
            compile_hf_layers(model)
        x = torch.randint(0, run.model.vocab_size, (run.train.micro_batch_size,
                                                   run.model.seq_length), device=device)
        pos = torch.arange(run.model.seq_length, device=device).expand_as(x)
        pair = [("ours", ours, lambda x, pos: ours(x, pos, labels=x).sum()),
                (name, model, loss_fn)]
        times = time_forward_backward(pair, (x, pos), mx.steps + 1, mx.warmup)
        cuda = torch.cuda.is_available()
        m = run.model
        row = {"kind": "peer", "peer": "HF Qwen3 (SDPA)", "mode": mode,
               "model": {"preset": m.name, "num_layers": m.num_layers,
                         "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn_hidden_size,
                         "num_attention_heads": m.num_attention_heads,
                         "num_query_groups": m.num_query_groups, "kv_channels": m.kv_channels,
                         "seq_length": m.seq_length, "vocab_size": m.padded_vocab_size},
               "micro_batch": run.train.micro_batch_size, "precision": run.train.precision,
               "ms_fwd_bwd": times[name] * 1e3, "ours_ms_fwd_bwd": times["ours"] * 1e3,
               "params": sum(p.numel() for p in model.parameters()),
               "transformers": _version("transformers"), "profile": None}
        try:
            row["profile"] = profile_call(lambda: (loss_fn(x, pos).backward(),
                                                   model.zero_grad(set_to_none=True)))
        except Exception as e:  # noqa: BLE001
            row["profile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if cuda:
            torch.cuda.synchronize()
        ours.zero_grad(set_to_none=True)
        return row

    rf.row("mixers", f"mixers/peer/hf_qwen3/{mode}", "peer", measure, release=False)


def run_moe(rf: RunFile, mx: Matrix, env: dict, options: dict) -> None:
    """Training steps over experts (:data:`MOE_ROWS`): the ``1p5b_moe`` preset at
    ``--mixer-layers``, eager (``train.compile=auto`` stays eager with experts), at vanilla's
    best micro-batch, each mixer row with its extra roofline floor against the vanilla row of
    the same experts implementation."""
    from depthmix.bench.roofline import step_extra_floor
    from depthmix.planning import hardware

    best = best_vanilla(rf.doc)
    mb = best["micro_batch"] if best else (1 if mx.smoke else 2)
    rf.doc["parts"]["moe"]["setting"] = {
        "micro_batch": mb, "from": best["id"] if best else "no vanilla row: the default"}
    preset, layers = mx.moe_shape
    shape = Shape(preset, layers, mx.seq, mb, mx.precision)
    device = hardware.device_named(env["device"]) if env.get("device_kind") else None
    floor_device = device or hardware.H100
    vanilla_ms: Dict[str, float] = {}
    settings = dict(MODE_SETTINGS["eager"])
    for mixer, experts in mx.moe_rows:
        def measure(mixer=mixer, experts=experts):
            impl = "torch" if mx.smoke else None  # on a GPU: auto, Triton where it has kernels
            run, overrides = compose(shape, mixer, impl, settings, options,
                                     extra=[f"model.moe.experts_impl={experts}"])
            why = fits(run, env)
            if why:
                raise Skip(why)
            row = measure_step(run, overrides, "eager", settings, mx.steps, mx.warmup,
                               profile=True)
            if mixer == "vanilla":
                vanilla_ms[experts] = row["ms_per_step"]
                return row
            floor = step_extra_floor(run, floor_device)
            row["extra_floor"] = {**floor.as_dict(), "device_measured": device is not None}
            row["vanilla_ms"] = base = vanilla_ms.get(experts)
            if base is not None:
                row["budget_ms"] = base + 1.5 * floor.seconds * 1e3
                row["within_floor_budget"] = row["ms_per_step"] <= row["budget_ms"]
            return row

        rf.row("moe", f"moe/{mixer}/{experts}/eager", "moe", measure)


def _tool(name: str):
    """A script of ``tools/`` as a module (its ``__main__`` block does not run)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CASE = re.compile(r"T(\d+)-G(\d+)-hd(\d+)-D(\d+)(?:-np(\d+))?")


def run_kernels(rf: RunFile, mx: Matrix, env: dict) -> None:
    """MoDA's kernels (``ours``, and ``fused`` where the bench has it) against the case's
    plain attention, forward + backward, with the full kernel's roofline floor and, where
    the bench defines it, the depth floor target ``ours <= baseline + 1.3 x depth floor``."""
    from depthmix import bench
    from depthmix.planning import hardware

    tool = _tool("bench_kernels")
    moda = bench.hooks("moda_attention")
    device = hardware.device_named(env["device"]) if env.get("device_kind") else None
    rep_ms, warmup_ms = (1, 0) if mx.smoke else (100, 25)  # do_bench's defaults
    for case in moda.cases(mx.smoke):
        label = case.shape
        if not mx.smoke and not (label.startswith("moda/paper") or "-G4-" in label):
            continue
        key = re.sub(r" \(depth floor[^)]*\)", "", label)  # the id: no device's numbers
        floor = depth_floor = None
        shape = _CASE.search(label)
        if shape and device is not None:
            t, g, hd, depth, heads = (int(x) if x else None for x in shape.groups())
            heads = heads or moda.NUM_HEADS
            floor = sum(w.floor(device)[0] for w in moda.work(t, heads, g, hd, depth)) * 1e3
            if hasattr(moda, "depth_floor"):
                dtype = torch.float32 if label.endswith("fp32") else torch.bfloat16
                depth_floor = moda.depth_floor(moda.Shape(t, heads, g, hd, depth, dtype),
                                               device) * 1e3
        names = [case.baseline] + [n for n in ("ours", "fused") if n in case.candidates]
        baseline_ms: Dict[str, float] = {}
        for name in names:
            def measure(name=name, case=case, floor=floor, depth_floor=depth_floor):
                fn = case.candidates[name]
                fwd, _ = tool.measure(fn, case.make_inputs, False, rep_ms, warmup_ms)
                both, peak = tool.measure(fn, case.make_inputs, True, rep_ms, warmup_ms)
                if name == case.baseline:
                    baseline_ms[key] = both * 1e3
                base = baseline_ms.get(key)
                row = {"kind": "kernel", "op": "moda_attention", "case": label,
                       "candidate": name, "baseline": case.baseline,
                       "fwd_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3,
                       "ratio": both * 1e3 / base if base else None,
                       "peak_mib": peak / 2 ** 20, "floor_ms": floor,
                       "depth_floor_ms": depth_floor, "rep_ms": rep_ms}
                if name == "ours" and base is not None and depth_floor is not None:
                    row["target_ms"] = base + 1.3 * depth_floor
                    row["within_target"] = both * 1e3 <= row["target_ms"]
                return row
            rf.row("kernels", f"kernels/{key}/{name}", "kernel", measure)


def run_checks(rf: RunFile) -> None:
    """The ``gpu``-marked tests of ``tests/`` (``pytest -m gpu``; they skip without CUDA), in
    one pytest process, a row each: a new GPU-only check is a test with the marker."""
    began = time.monotonic()
    try:
        ids = gpu_tests()
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        rf.record("checks", "checks/pytest -m gpu", {"status": "skipped",
                                                      "reason": f"{type(e).__name__}: {e}"},
                  began)
        return
    done = {r["id"] for r in rf.doc["rows"] if r["status"] == "ok"}
    ids = [i for i in ids if rf.wanted(check_id(i)) and check_id(i) not in done]
    if not ids:
        return
    left = rf.deadline - time.monotonic()
    outcomes = run_tests(ids, timeout=None if left == float("inf") else max(left, 60.0))
    for nodeid in ids:
        name = check_id(nodeid)[len("checks/"):]
        status, seconds, message = outcomes.get(nodeid, ("skipped", 0.0, None))
        if status in ("passed", "failed"):
            fields = {"status": "ok", "reason": None, "kind": "check", "check": name,
                      "passed": status == "passed",
                      "details": {"test": nodeid, "message": message}}
        elif nodeid not in outcomes:
            fields = {"status": "skipped", "reason": "time budget: pytest was stopped first; "
                      f"run it with --part checks --rows '{re.escape(check_id(nodeid))}'"}
        else:
            fields = {"status": status, "reason": message}
        rf.record("checks", check_id(nodeid), fields, time.monotonic() - seconds)


def check_id(nodeid: str) -> str:
    """``checks/<test file stem>::<test>`` of a test's node id."""
    path, _, test = nodeid.partition("::")
    return f"checks/{os.path.basename(path)[:-3]}::{test}"


PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q",
          "--continue-on-collection-errors"]
"""pytest in one process (no xdist workers, whatever the project's options say); a test
module this machine cannot import costs its own tests only."""


def gpu_tests() -> List[str]:
    """Node ids of the tests marked ``gpu``."""
    proc = subprocess.run([*PYTEST, "--collect-only", "-m", "gpu", "tests"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    if not ids:
        raise RuntimeError(f"pytest --collect-only -m gpu: exit {proc.returncode}: "
                           + (proc.stdout + proc.stderr)[-500:])
    return ids


def run_tests(ids: List[str], timeout: Optional[float]) -> Dict[str, tuple]:
    """Run ``ids`` in one pytest process: node id -> (passed | failed | skipped | error,
    seconds, message). At ``timeout`` pytest is interrupted (SIGINT) and reports what it
    finished."""
    import signal
    import xml.etree.ElementTree as ET

    report = os.path.join(tempfile.mkdtemp(prefix="gpu_tests_"), "junit.xml")
    proc = subprocess.Popen([*PYTEST, "-m", "gpu", f"--junitxml={report}", *ids], cwd=REPO)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if not os.path.exists(report):
        return {}
    by_name = {(os.path.basename(i.partition("::")[0])[:-3], i.partition("::")[2]): i
               for i in ids}
    out = {}
    for case in ET.parse(report).iter("testcase"):
        nodeid = by_name.get((case.get("classname", "").rpartition(".")[2], case.get("name")))
        if nodeid is None:
            continue
        status, message = "passed", None
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                status, message = outcome, (found.get("message") or found.text or "")[:500]
                break
        out[nodeid] = (status, float(case.get("time") or 0.0), message)
    return out


# ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():  # before any kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from depthmix import runtime
    from depthmix.runtime import log as run_log

    run_log.quiet_libraries(verbose=False)
    runtime.install()
    out = args.out or os.environ.get("OUT") or "gpu-run"
    env = environment(args.git_file)
    options = train_options()
    rf = RunFile(args, out, env, options)
    rf.log(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | "
           f"megatron-core {env['megatron_core']} | commit {env['git_commit']}"
           f"{' (dirty)' if env['git_dirty'] else ''} | fast paths: "
           + ", ".join(f"{k}={'yes' if v else 'absent'}" for k, v in options.items()))
    mx = Matrix(args, env)
    parts = PARTS if args.part == "all" else (args.part,)
    for part in parts:
        rf.start_part(part)
        try:
            if part == "vanilla":
                run_vanilla(rf, mx, env, options)
            elif part == "mixers":
                run_mixers(rf, mx, env, options)
            elif part == "moe":
                run_moe(rf, mx, env, options)
            elif part == "kernels":
                run_kernels(rf, mx, env)
            else:
                run_checks(rf)
            rf.end_part(part)
        except Exception as e:  # noqa: BLE001 -- a part that breaks leaves the others
            with open(rf.log_path, "a") as f:
                traceback.print_exc(file=f)
            rf.end_part(part, "skipped", f"{type(e).__name__}: {str(e)[:300]}")
            rf.log(f"part {part} broke: {type(e).__name__}: {e}")
    rows = rf.doc["rows"]
    counts = {s: sum(r["status"] == s for r in rows) for s in gpu_runs.ROW_STATES}
    rf.log(f"== {len(rows)} rows: " + ", ".join(f"{v} {k}" for k, v in counts.items())
           + f"; {time.monotonic() - rf.began:.0f} s; {rf.path}")
    problems = gpu_runs.validate(rf.doc)
    for p in problems:
        rf.log(f"schema: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
