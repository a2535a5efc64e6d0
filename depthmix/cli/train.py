"""``depthmix-train``: parse the Hydra config, build, train, close.

    depthmix-train model=tiny mixer=depth_attn
    torchrun --nproc-per-node 8 -m depthmix.cli.train model=3b mixer=moda parallel=tp2_pp4
    depthmix-train -m model=500m mixer=depth_attn mixer.stride=6,12,24
    depthmix-train model=tiny run.name=first     # outputs/first; the same command resumes
    depthmix-train model=3b parallel=tp2_pp4 train.dry_run=true parallel.world_size=64

Exit status (:mod:`depthmix.runtime.exit_codes`): 0 when training finished *or* was stopped
by a preemption signal after saving a checkpoint (re-run the same command / requeue to
resume); 2 for a configuration error; 3 when training diverged (``train.on_nonfinite=stop``
or ``train.max_nonfinite_steps`` non-finite steps in a row); 130 for a second Ctrl-C; 1 for
anything else.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from typing import Optional, TextIO

import hydra
from omegaconf import DictConfig

from depthmix import runtime
from depthmix.cli.command import HydraTask, command
from depthmix.config.load import resolve
from depthmix.config.schema import ConfigError, RunConfig
from depthmix.config.store import register_configs
from depthmix.runtime import env as launch_env
from depthmix.runtime import exit_codes
from depthmix.runtime import log as run_log


@command
def train(cfg: DictConfig) -> int:
    """One run (a Hydra job): the dry run's report, or build, train and close."""
    launch_env.mark_job_start()
    try:
        if not cfg.train.dry_run and _already_finished(cfg):
            return exit_codes.OK
        run = resolve(cfg)
        if run.train.dry_run:
            return dry_run(run)
        run_log.quiet_libraries(run.train.verbose)  # before Megatron's import-time info lines
        with runtime.installed():  # holds the libraries' warnings before Megatron is imported
            return _train(run)
    except ConfigError:
        _discard_fresh_output_dir()
        raise


def _discard_fresh_output_dir() -> None:
    """A run refused by its start-up checks leaves nothing behind: its Hydra output
    directory when that holds only Hydra's record and the log, and the parents Hydra made
    for it that are now empty (``outputs/local/<time>``)."""
    from hydra.core.hydra_config import HydraConfig

    from hydra.types import RunMode

    if (launch_env.launcher_rank() != 0 or not HydraConfig.initialized()
            or HydraConfig.get().mode == RunMode.MULTIRUN):  # the sweep summary lists it
        return
    out = os.path.abspath(HydraConfig.get().runtime.output_dir)
    if not os.path.isdir(out) or set(os.listdir(out)) - {".hydra", "train.log"}:
        return
    shutil.rmtree(out, ignore_errors=True)
    parent, stop = os.path.dirname(out), os.path.abspath(os.getcwd())
    while (parent.startswith(stop + os.sep) and os.path.basename(parent)
           not in ("outputs", "multirun") and not os.listdir(parent)):
        os.rmdir(parent)
        parent = os.path.dirname(parent)


def _already_finished(cfg: DictConfig) -> bool:
    """A re-run of a finished run says so (its checkpoint has reached ``train.steps``)
    instead of loading it and opening another W&B run; a larger ``train.steps`` trains on.
    Read from the composed config before it is resolved (which imports torch)."""
    from types import SimpleNamespace

    from depthmix.checkpoint.resume import finished_at

    train = SimpleNamespace(steps=int(cfg.train.steps), save_dir=cfg.train.save_dir)
    run = SimpleNamespace(train=train, output_dir=str(cfg.output_dir))
    step = finished_at(run)
    if step is None:
        return False
    if launch_env.launcher_rank() == 0:
        run_log.say(f"run already finished at step {step}/{run.train.steps}: "
                    f"{shlex.quote(run_log.short_path(run.output_dir))} (raise train.steps to "
                    "train further)")
    return True


def _train(run: RunConfig) -> int:
    from depthmix.pretrain.callbacks.preemption import mark_clean_exit
    from depthmix.pretrain.health import TrainingDiverged
    from depthmix.pretrain.trainer import Trainer, default_callbacks

    launch_env.ensure_distributed_env()  # srun/submitit tasks without torchrun
    launch_env.set_torch_threads()
    launch_env.quiet_nonzero_rank_logging(launch_env.launcher_rank())
    trainer = Trainer(run, callbacks=default_callbacks(run))  # restored from its checkpoint
    diverged = None
    try:
        trainer.train()
    except TrainingDiverged as exc:
        trainer.on_error(exc)
        diverged = exc
    except BaseException as exc:
        trainer.on_error(exc)
        raise
    finally:
        trainer.close()  # the closing summary (callbacks.RunSummary) says how to resume
    if diverged is not None:
        print(f"[depthmix] {diverged}", file=sys.stderr, flush=True)
        return exit_codes.DIVERGED
    mark_clean_exit(f"{trainer.stop_reason or 'finished'} at step {trainer.step}")
    return exit_codes.OK


@command
def dry_run(run: RunConfig, world_size: Optional[int] = None,
            out: Optional[TextIO] = None) -> int:
    """``train.dry_run=true``: every start-up check, then the plan
    (:mod:`depthmix.planning.dry_run`); nothing is built."""
    out = out or sys.stdout
    from depthmix.mixers import mixer_of
    from depthmix.planning import dry_run as plan
    from depthmix.pretrain.preflight import preflight

    world_size = plan.world_size_of(run) if world_size is None else world_size
    preflight(run, world_size)
    plan.report(run, mixer_of(run), world_size, out)
    print(f"dry run OK for world size {world_size}", file=out, flush=True)
    return exit_codes.OK


job = HydraTask(train)
"""What Hydra runs per job (and a submitit job unpickles)."""
hydra_main = hydra.main(config_path="../configs", config_name="config", version_base=None)(job)


def _nonzero_rank_overrides() -> list:
    """Ranks other than 0 write no ``.hydra`` directory and no log file; their console
    shows warnings and errors only (:func:`launch_env.quiet_nonzero_rank_logging`)."""
    if launch_env.launcher_rank() == 0:
        return []
    return ["hydra.output_subdir=null", "hydra/hydra_logging=none", "hydra/job_logging=console"]


@command
def main() -> Optional[int]:
    from depthmix.cli.overrides import before_hydra

    status = before_hydra(sys.argv[1:])  # --help, bad overrides, multirun dry runs
    if status is not None:
        return status
    register_configs()
    launch_env.register_resolvers()
    os.environ.setdefault("DEPTHMIX_RUN_KEY", launch_env.run_key())  # one key for all ranks
    sys.argv.extend(_nonzero_rank_overrides())
    hydra_main()  # exits with the run's status when it is not 0
    return exit_codes.OK


if __name__ == "__main__":
    # `python -m depthmix.cli.train`: run the importable module, whose task Hydra names the
    # job after (``train``) and a submitit job can unpickle
    from depthmix.cli.train import main as importable_main

    sys.exit(importable_main())
