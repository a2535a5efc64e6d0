"""``depthmix-train``: parse the Hydra config, build, train, close.

    depthmix-train model=tiny mixer=depth_attn
    torchrun --nproc-per-node 8 -m depthmix.cli.train model=3b mixer=moda parallel=tp2_pp4
    depthmix-train -m model=500m mixer=depth_attn mixer.stride=6,12,24
    depthmix-train model=tiny run.name=first     # outputs/first; the same command resumes
    depthmix-train model=3b parallel=tp2_pp4 train.dry_run=true parallel.world_size=64

Exit status: 0 when training finished *or* was stopped by a preemption signal after
saving a checkpoint (re-run the same command / requeue to resume); 2 for a configuration
error; 3 when training diverged (``train.on_nonfinite=stop`` or
``train.max_nonfinite_steps`` non-finite steps in a row); 1 for anything else.
"""

from __future__ import annotations

import logging
import os
import sys

from depthmix.runtime import log as run_log

run_log.startup_warnings.start()  # before anything imports Megatron; reported at pre_train

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from depthmix.config.load import resolve
from depthmix.config.schema import ConfigError
from depthmix.config.store import register_configs
from depthmix.runtime import env as launch_env

log = logging.getLogger("depthmix")

launch_env.register_resolvers()  # at import: submitit's jobs unpickle this module


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    try:
        trainer = _start(cfg)
    except ConfigError as e:  # the resolved config, the preflight, a checkpoint that does not fit
        print(f"configuration error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    from depthmix.pretrain.health import EXIT_DIVERGED, TrainingDiverged

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
        sys.exit(EXIT_DIVERGED)
    from depthmix.pretrain.callbacks.preemption import mark_clean_exit

    mark_clean_exit(f"{trainer.stop_reason or 'finished'} at step {trainer.step}")


def _start(cfg: DictConfig):
    """The trainer of this run (restored from its checkpoint), or the dry run's exit."""
    run = resolve(cfg)
    if run.train.dry_run:
        from depthmix.planning import dry_run
        from depthmix.pretrain.preflight import preflight

        sys.exit(dry_run.main(run, check=preflight))
    run_log.quiet_libraries(run.train.verbose)  # before Megatron's import-time info lines
    from depthmix.pretrain.trainer import Trainer, default_callbacks  # imports Megatron

    launch_env.ensure_distributed_env()  # srun/submitit tasks without torchrun
    launch_env.quiet_nonzero_rank_logging(launch_env.launcher_rank())
    return Trainer(run, callbacks=default_callbacks(run))


def _nonzero_rank_overrides() -> list:
    """Ranks other than 0 write no ``.hydra`` directory and no log file; their console
    shows warnings and errors only (:func:`launch_env.quiet_nonzero_rank_logging`)."""
    if launch_env.launcher_rank() == 0:
        return []
    return ["hydra.output_subdir=null", "hydra/hydra_logging=none", "hydra/job_logging=console"]


def main() -> None:
    from depthmix.cli.overrides import before_hydra

    before_hydra(sys.argv[1:])  # --help, bad overrides (exit 2), multirun dry runs
    register_configs()
    os.environ.setdefault("DEPTHMIX_RUN_KEY", launch_env.run_key())  # one key for all ranks
    sys.argv.extend(_nonzero_rank_overrides())
    hydra_main()


if __name__ == "__main__":
    main()
