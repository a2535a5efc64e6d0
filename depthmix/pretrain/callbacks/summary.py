"""The closing lines of every run: how it ended, where its outputs are, how to resume.

    run finished at step 300/300 | train loss 2.8121 | eval loss 2.9034 | wall 4 min 12 s
    outputs: outputs/local/2026-11-24_01-10-03/tiny_vanilla (train.log, checkpoints, wandb)
    last checkpoint: outputs/local/2026-11-24_01-10-03/tiny_vanilla/checkpoints/iter_0000300

A run that did not finish (preempted, ``train.exit_after_steps``, an error after the model
was built) adds the command that resumes it: the same command with ``run.name=...``
naming its directory (or unchanged when the command already fixes the directory).
"""

from __future__ import annotations

import glob
import json
import math
import os
import shlex
import sys
import time
from typing import List, Mapping, Optional, Sequence

import psutil

from depthmix.checkpoint.store import latest_checkpoint
from depthmix.config.sweep import RESULT_FILE
from depthmix.pretrain.callbacks.base import Callback
from depthmix.runtime import exit_codes
from depthmix.runtime.env import job_start
from depthmix.runtime.log import say, short_path

# added by depthmix-train itself on ranks other than 0, never typed by the user
_INTERNAL = ("hydra.output_subdir=", "hydra/hydra_logging=", "hydra/job_logging=")


def _exit_code(error: Optional[BaseException]) -> int:
    """The status ``depthmix-train`` ends with after ``error`` (None: 0)."""
    if error is None:
        return exit_codes.OK
    if type(error).__name__ == "TrainingDiverged":  # pretrain.health imports torch
        return exit_codes.DIVERGED
    return exit_codes.INTERRUPTED if isinstance(error, KeyboardInterrupt) else exit_codes.CRASH


def _wall(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h} h {m} min" if h else f"{m} min {s} s" if m else f"{s} s"


def launch_command(argv: Sequence[str] = sys.argv, env: Mapping[str, str] = os.environ,
                   parent_cmdline: Optional[List[str]] = None) -> List[str]:
    """The command that started this run, as the user would type it: under torchrun the
    agent's command line, else ``depthmix-train`` / ``python -m depthmix.cli.train``
    with this process's arguments."""
    if "TORCHELASTIC_RUN_ID" in env:
        if parent_cmdline is None:
            try:
                parent_cmdline = psutil.Process(os.getppid()).cmdline()
            except psutil.Error:  # the agent is gone, or not ours to read
                parent_cmdline = None
        if parent_cmdline:
            cmd = list(parent_cmdline)
            if len(cmd) > 1 and os.path.basename(cmd[1]) == "torchrun":
                return ["torchrun", *cmd[2:]]
            if os.path.basename(cmd[0]).startswith("python"):
                cmd[0] = "python"
            return cmd
    program = os.path.basename(argv[0]) if argv else "depthmix-train"
    head = ["depthmix-train"] if program.startswith("depthmix-train") else \
        ["python", "-m", "depthmix.cli.train"]
    return head + [a for a in argv[1:] if not a.startswith(_INTERNAL)]


def directory_option(output_dir: str, multirun: bool = False, cwd: Optional[str] = None) -> str:
    """The option that sends a run to ``output_dir`` again: ``run.name=<dir under
    outputs/>`` (a multirun's: its sweep directory under ``multirun/``), else
    ``hydra.run.dir=<dir>`` (``hydra.sweep.dir``) for a directory elsewhere."""
    cwd = os.path.abspath(cwd or os.getcwd())
    target = os.path.abspath(output_dir)
    if multirun:
        target = os.path.dirname(target)  # multirun/<key>/<n>_<overrides> -> the sweep
    root = os.path.join(cwd, "multirun" if multirun else "outputs")
    if os.path.commonpath([root, target]) == root and target != root:
        return f"run.name={os.path.relpath(target, root)}"
    return f"hydra.{'sweep' if multirun else 'run'}.dir={target}"


def resume_command(output_dir: str, command: List[str], multirun: bool = False,
                   cwd: Optional[str] = None) -> str:
    """``command`` plus :func:`directory_option`, or unchanged when it already fixes its
    directory (``run.name=``, ``hydra.run.dir=`` / ``hydra.sweep.dir=``)."""
    fixed = ("run.name=", "hydra.sweep.dir=") if multirun else ("run.name=", "hydra.run.dir=")
    if any(a.startswith(fixed) for a in command):
        return shlex.join(command)
    return shlex.join([*command, directory_option(output_dir, multirun, cwd)])


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


class RunSummary(Callback):
    """On the loss rank, at ``close``: finished / preempted / stopped / failed, steps,
    final train and eval loss, wall time (since the process started), the output
    directory, the last checkpoint, and the command that resumes an unfinished run. Put it
    before :class:`PreemptionCallback` (whose ``close`` may hand over to submitit)."""

    def __init__(self):
        self.started = job_start() or psutil.Process().create_time()
        self.eval_loss: Optional[float] = None
        self.tokens_per_s: Optional[float] = None
        self.error: Optional[BaseException] = None

    def post_step(self, trainer, result) -> None:
        if result.perf is not None:
            self.tokens_per_s = result.perf.as_dict().get("perf/tokens_per_s")

    def post_eval(self, trainer, result) -> None:
        self.eval_loss = result.loss

    def on_error(self, trainer, exc: BaseException) -> None:
        if not isinstance(exc, SystemExit) or exc.code not in (0, None):
            self.error = exc

    def _ending(self, trainer) -> str:
        if self.error is not None:
            text = str(self.error).strip().splitlines()
            return (f"run stopped on error ({type(self.error).__name__}"
                    f"{': ' + text[0] if text else ''})")
        if trainer.step >= trainer.run.train.steps:
            return "run finished"
        if trainer.stop_reason:
            return f"run {trainer.stop_reason}"
        return "run stopped (train.exit_after_steps)"

    def lines(self, trainer) -> List[str]:
        run, t = trainer.run, trainer.run.train
        head = f"{self._ending(trainer)} at step {trainer.step}/{t.steps}"
        if trainer.last is not None:
            head += f" | train loss {trainer.last.loss:.4f}"
        if self.eval_loss is not None:
            head += f" | eval loss {self.eval_loss:.4f}"
        head += f" | wall {_wall(time.time() - self.started)}"
        out = shlex.quote(short_path(run.output_dir))
        contents = [n for n in ("train.log", "checkpoints", "wandb", "depth_stats", "profile")
                    if os.path.exists(os.path.join(run.output_dir, n))]
        lines = [head, f"outputs: {out}" + (f" ({', '.join(contents)})" if contents else "")]
        last = latest_checkpoint(trainer.state.save_dir)
        lines.append(f"last checkpoint: {shlex.quote(short_path(last)) if last else 'none'}")
        wandb_dir = next((cb.directory for cb in trainer.callbacks
                          if getattr(cb, "directory", None)), None)
        if wandb_dir and run.logger.mode == "offline":
            lines.append(f"W&B (offline): {sync_command(wandb_dir)}")
        if trainer.step < t.steps or self.error is not None:
            multirun = _is_multirun()
            if os.environ.get("SLURM_JOB_ID"):
                lines.append("resume: a requeued job resumes by itself; a new job: add "
                             f"{shlex.quote(directory_option(run.output_dir, multirun))} to its training "
                             "arguments")
            else:
                command = resume_command(run.output_dir, launch_command(), multirun)
                lines.append(f"resume: {command}")
        return lines

    def result(self, trainer) -> dict:
        """The numbers of the closing summary, for the sweep summary."""
        last = trainer.last
        return {"status": self._ending(trainer).split(" (")[0].replace("run ", "", 1),
                "exit_code": _exit_code(self.error), "step": trainer.step,
                "steps": trainer.run.train.steps,
                "train_loss": None if last is None else last.loss,
                "eval_loss": self.eval_loss,
                "eval_ppl": None if self.eval_loss is None else math.exp(min(self.eval_loss, 50)),
                "tokens_per_s": self.tokens_per_s,
                "wall_s": round(time.time() - self.started, 1),
                "output_dir": os.path.abspath(trainer.run.output_dir)}

    def close(self, trainer) -> None:
        if not trainer.topo.is_logging_rank:
            return
        for line in self.lines(trainer):
            say(line)
        path = os.path.join(trainer.run.output_dir, RESULT_FILE)
        with open(path, "w") as f:
            json.dump(self.result(trainer), f, indent=1)


def sync_command(wandb_dir: str) -> str:
    """``wandb sync`` with every offline segment of the run (one ``offline-run-<time>-<id>``
    directory per job that logged to it: the first and each resumed one), oldest first."""
    run_id = os.path.basename(wandb_dir).rsplit("-", 1)[-1]
    segments = sorted(glob.glob(os.path.join(os.path.dirname(wandb_dir), f"*run-*-{run_id}")))
    return shlex.join(["wandb", "sync", *map(short_path, segments or [wandb_dir])])
