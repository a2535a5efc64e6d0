#!/usr/bin/env python
"""Fault injection: does a run that is interrupted and relaunched end exactly where an
uninterrupted run ends?

Runs a short ``depthmix-train`` job (torchrun, ``--nproc`` ranks) once uninterrupted, then
again with ``--faults`` interruptions at seeded random moments, relaunching the same command
until it finishes. The faults, drawn in turn:

* ``kill_all``: SIGKILL of every process of the job (torchrun, ranks, writers);
* ``kill_rank``: SIGKILL of one rank (torchrun then stops the others);
* ``sigterm`` / ``sigint``: to every rank (a scheduler's preemption, Ctrl-C): the job saves
  and exits 0;
* ``kill_in_save``: SIGKILL of every process while a background checkpoint write is in
  flight (the writers are slowed by ``DEPTHMIX_CKPT_WRITER_DELAY`` for that attempt).

Reported: whether every step's loss (every attempt's, to the last bit), everything in the
final checkpoint (weights, optimizer state, schedule, RNG states, data position; each
tensor with ``torch.equal``) and the final evaluation loss equal the uninterrupted run's, and whether any process outlived an attempt.
Exit status 0 when all hold, 1 otherwise.

    python tools/chaos.py --faults 20 parallel=pp2 mixer=attnres_block
    python tools/chaos.py --faults 20 parallel=dp2_distopt mixer=depth_attn
    python tools/chaos.py --nproc 4 model=my_model parallel=tp2_pp2 train.steps=40   # yours

Arguments after the options are ``depthmix-train`` overrides (``train.save_dir``,
``output_dir`` and ``train.save_interval`` are set by the tool unless given).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from depthmix.checkpoint import store

FAULTS = ("kill_all", "kill_rank", "sigterm", "sigint", "kill_in_save")
QUICK = ["model=tiny", "logger=none", "train.log_interval=1", "train.micro_batch_size=4",
         "train.global_batch_size=8", "data.embedded_documents=600"]
LOSS_LOG_ENV = "DEPTHMIX_CHAOS_LOSSES"
WRITER_DELAY_ENV = "DEPTHMIX_CKPT_WRITER_DELAY"  # depthmix.checkpoint.background


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--faults", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: enough for every fault to hit, "
                        "max(12, 2 x faults + 6))")
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--writer-delay", type=float, default=2.0,
                   help="seconds each writer is held in a kill_in_save attempt")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--attempt-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("overrides", nargs="*", help="depthmix-train overrides")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
# Inside each rank: depthmix-train with one more callback that logs losses exactly
# ---------------------------------------------------------------------------------------


def worker() -> None:
    """``python tools/chaos.py --worker <overrides>`` under torchrun: ``depthmix-train``
    whose logging rank appends ``step <n> <loss as float.hex>`` (and ``eval``) lines."""
    from depthmix.cli import train as cli
    from depthmix.pretrain import trainer as trainer_module
    from depthmix.pretrain.callbacks import Callback

    class LossLog(Callback):
        def _write(self, trainer, text):
            if trainer.topo.is_logging_rank:
                with open(os.environ[LOSS_LOG_ENV], "a") as f:
                    f.write(text + "\n")

        def post_step(self, trainer, result):
            self._write(trainer, f"step {trainer.step} {float(result.loss).hex()}")

        def post_eval(self, trainer, result):
            self._write(trainer, f"eval {trainer.step} {float(result.loss).hex()}")

    default = trainer_module.default_callbacks

    def with_loss_log(run):
        return [LossLog(), *default(run)]

    trainer_module.default_callbacks = with_loss_log
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    sys.exit(cli.main())


# ---------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------


class Attempt:
    def __init__(self, args, overrides, workdir, losses, env_extra):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
        env[LOSS_LOG_ENV] = losses
        env.pop(WRITER_DELAY_ENV, None)
        env.update(env_extra)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", os.path.abspath(__file__), "--worker",
               *overrides]
        self.log = open(os.path.join(workdir, "console.log"), "a")
        self.p = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self.seen = {}  # pid -> psutil.Process: everything the job started
        self.started = time.monotonic()

    def watch(self):
        import psutil

        try:
            root = psutil.Process(self.p.pid)
            for proc in [root, *root.children(recursive=True)]:
                self.seen.setdefault(proc.pid, proc)
        except psutil.NoSuchProcess:
            pass

    def ranks(self):
        import psutil

        out = []
        for proc in self.seen.values():
            try:
                if proc.is_running() and "RANK" in proc.environ() and \
                        "--worker" in proc.cmdline() and proc.pid != self.p.pid:
                    if proc.ppid() == self.p.pid:
                        out.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return out

    def kill_all(self):
        self.watch()
        for proc in self.seen.values():
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - gone already
                pass

    def survivors(self, within=10.0) -> list:
        import psutil

        deadline = time.monotonic() + within
        while True:
            alive = []
            for proc in self.seen.values():
                try:
                    if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                        alive.append(proc.pid)
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)


def _steps_logged(path: str) -> int:
    if not os.path.exists(path):
        return 0
    return sum(1 for line in open(path) if line.startswith("step "))


def run_job(args, overrides, workdir, fault=None, rng=None) -> dict:
    """One attempt; ``fault``: which interruption, at a random moment after the attempt's
    first logged step (``kill_in_save``: once a background write is in flight)."""
    losses = os.path.join(workdir, "losses.txt")
    save_dir = os.path.join(workdir, "ckpt")
    env = {WRITER_DELAY_ENV: str(args.writer_delay)} if fault == "kill_in_save" else {}
    before = _steps_logged(losses)
    attempt = Attempt(args, overrides, workdir, losses, env)
    # the moment: after 1-3 new steps of this attempt and up to half a second more; a
    # kill_in_save once this attempt's first background write is in flight
    after = before + (rng.randint(1, 3) if rng else 0)
    wait = rng.uniform(0.0, 0.5) if rng else 0.0
    hit_at = None
    try:
        while attempt.p.poll() is None:
            attempt.watch()
            if time.monotonic() - attempt.started > args.attempt_timeout:
                attempt.kill_all()
                raise RuntimeError(f"attempt timed out; see {workdir}/console.log")
            if fault and hit_at is None:
                done = _steps_logged(losses)
                if fault == "kill_in_save":
                    ready = done > before and store.writes_in_progress(save_dir)
                else:
                    ready = done >= after
                if ready:
                    time.sleep(wait if fault != "kill_in_save" else 0.0)
                    hit_at = _steps_logged(losses)
                    _inject(attempt, fault, rng)
            time.sleep(0.05)
    finally:
        if attempt.p.poll() is None:
            attempt.kill_all()
        attempt.p.wait()
        attempt.log.close()
    return {"fault": fault, "hit": hit_at is not None, "code": attempt.p.returncode,
            "survivors": attempt.survivors(), "seconds": round(time.monotonic()
                                                               - attempt.started, 1)}


def _inject(attempt, fault, rng) -> None:
    attempt.watch()
    if fault in ("kill_all", "kill_in_save"):
        attempt.kill_all()
        return
    ranks = attempt.ranks()
    if fault == "kill_rank":
        if ranks:
            rng.choice(ranks).kill()
        return
    sig = signal.SIGTERM if fault == "sigterm" else signal.SIGINT
    for proc in ranks:
        try:
            proc.send_signal(sig)
        except Exception:  # noqa: BLE001 - gone already
            pass


def _read(path: str) -> dict:
    """{('step'|'eval', n): set of hex losses} from a losses file."""
    out = {}
    if os.path.exists(path):
        for line in open(path):
            parts = line.split()
            if len(parts) == 3 and parts[0] in ("step", "eval"):  # (a kill may cut one)
                out.setdefault((parts[0], int(parts[1])), set()).add(parts[2])
    return out


def _finished(save_dir: str, steps: int) -> bool:
    return any(step >= steps for step, _ in store.list_checkpoints(save_dir))


def _state(save_dir: str, steps: int) -> dict:
    """Everything in the checkpoint of ``steps`` (weights, optimizer, schedule, RNG, data
    position) by key, or {} when it is missing."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = dict(store.list_checkpoints(save_dir)).get(steps)
    if path is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "state.pt"))
        return torch.load(os.path.join(tmp, "state.pt"), weights_only=False)


def _equal(a, b) -> bool:
    import numpy as np
    import torch

    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _differing(ref: dict, got: dict) -> list:
    if not ref:
        return ["<the uninterrupted run has no final checkpoint>"]
    keys = sorted(set(ref) | set(got))
    return [k for k in keys if k not in ref or k not in got or not _equal(ref[k], got[k])]


def chaos(args) -> dict:
    if args.steps is None:
        args.steps = max(12, 2 * args.faults + 6)
    workroot = args.dir or tempfile.mkdtemp(prefix="chaos_")
    given = {o.split("=", 1)[0] for o in args.overrides}
    base = [*QUICK, f"train.steps={args.steps}", f"train.eval_interval={args.steps}",
            f"train.save_interval={args.save_interval}", *args.overrides]
    base = [o for o in base if o.split("=", 1)[0] not in given or o in args.overrides]
    runs = {}
    began = time.monotonic()
    for name in ("reference", "interrupted"):
        workdir = os.path.join(workroot, name)
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir)
        overrides = [*base]
        if "train.save_dir" not in given:
            overrides.append(f"train.save_dir={workdir}/ckpt")
        if "output_dir" not in given:
            overrides.append(f"output_dir={workdir}/out")
        runs[name] = {"dir": workdir, "overrides": overrides}
    ref = runs["reference"]
    result = run_job(args, ref["overrides"], ref["dir"])
    if result["code"] != 0:
        raise RuntimeError(f"the uninterrupted run failed ({result['code']}); see "
                           f"{ref['dir']}/console.log")
    rng = random.Random(args.seed)
    run = runs["interrupted"]
    attempts, faults = [], [FAULTS[i % len(FAULTS)] for i in range(args.faults)]
    rng.shuffle(faults)
    for fault in faults:
        if _finished(os.path.join(run["dir"], "ckpt"), args.steps):
            break  # (more steps: --steps)
        attempts.append(run_job(args, run["overrides"], run["dir"], fault, rng))
        print(f"attempt {len(attempts)}: {fault}, exit {attempts[-1]['code']}, "
              f"{'hit' if attempts[-1]['hit'] else 'finished before the fault'}, "
              f"survivors {attempts[-1]['survivors']}", flush=True)
    for _ in range(5):  # relaunch until it finishes
        if _finished(os.path.join(run["dir"], "ckpt"), args.steps):
            break
        attempts.append(run_job(args, run["overrides"], run["dir"]))
    expected, got = _read(os.path.join(ref["dir"], "losses.txt")), \
        _read(os.path.join(run["dir"], "losses.txt"))
    step_keys = [k for k in expected if k[0] == "step"]
    loss_equal = all(got.get(k) == v for k, v in expected.items() if k[0] == "step") and \
        all(k in expected and v == expected[k] for k, v in got.items() if k[0] == "step")
    evals = [k for k in expected if k[0] == "eval"]
    eval_equal = bool(evals) and all(got.get(k) == expected[k] for k in evals)
    differing = _differing(_state(os.path.join(ref["dir"], "ckpt"), args.steps),
                           _state(os.path.join(run["dir"], "ckpt"), args.steps))
    weights_equal = not any(k.startswith("model") for k in differing)
    survivors = sum(len(a["survivors"]) for a in attempts) + len(result["survivors"])
    report = {
        "overrides": args.overrides, "nproc": args.nproc, "steps": args.steps,
        "faults": args.faults, "seed": args.seed, "faults_hit": sum(a["hit"] for a in attempts),
        "attempts": len(attempts), "steps_compared": len(step_keys),
        "losses_equal": loss_equal, "final_weights_equal": weights_equal,
        "final_eval_equal": eval_equal, "final_checkpoint_equal": not differing,
        "differing_in_final_checkpoint": differing[:10],
        "survivors": survivors,
        "finished": _finished(os.path.join(run["dir"], "ckpt"), args.steps),
        "seconds": round(time.monotonic() - began, 1), "attempt_log": attempts,
        "dir": workroot,
    }
    report["ok"] = all((loss_equal, weights_equal, eval_equal, survivors == 0,
                        report["finished"]))
    if not args.dir and report["ok"]:
        shutil.rmtree(workroot, ignore_errors=True)
    return report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker()
    args = parse_args(argv)
    # stopped itself: unwind, so the running attempt's processes are killed (run_job)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    report = chaos(args)
    summary = {k: v for k, v in report.items() if k != "attempt_log"}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
