"""Weights & Biases from the one rank that sees the loss.

* ``logger.mode``: ``offline`` (default: files under ``<logger.dir or output_dir>/wandb``,
  upload later with ``wandb sync``), ``online``, or ``disabled``.
* The run id lives in ``<save_dir>/wandb_run_id.txt``: a job resumed from that checkpoint
  directory (requeue, re-run) continues the same W&B run (``resume="allow"``), its steps
  continuing from the checkpoint's. Offline, each job writes its own
  ``offline-run-<time>-<id>`` directory with that id; ``wandb sync`` merges them.
* Group (``logger.group``): the sweep directory's name for every point of a multirun,
  ``run.name`` for one run; kept in ``<save_dir>/wandb_group.txt``, where evaluations of
  the checkpoints find it. Job type ``train``; tags ``model:<name>``, ``mixer:<name>``;
  display name :func:`default_name` (``logger.name`` may interpolate the run config).
* Logged: the full resolved config (plus layout, world size, FLOPs per token); every
  ``train.log_interval`` steps ``train/{loss,lr,grad_norm,loss_scale,skipped,
  nonfinite_steps,consumed_samples,tokens}``,
  ``perf/{tokens_per_s,tflops_per_device,mfu,step_time_s}``, ``mem/*``, with experts
  ``moe/{aux_loss,z_loss,load_max_over_mean,dropped}`` and per MoE layer ``u``
  ``moe/{aux_loss,z_loss,load_max_over_mean,tokens_max,tokens_mean,dropped}/layer<u>``
  (:class:`~depthmix.pretrain.experts.ExpertLoad`); after each
  evaluation ``val/{loss,ppl}``; the depth statistics a
  :class:`~depthmix.pretrain.callbacks.depth_stats.DepthStatsCallback` hands over (every
  ``logger.depth_stats_interval`` steps) as heatmaps (``depth/<name>/heatmap``, a
  ``wandb.Image``), a table and scalars; with experts, at the same interval, the expert-load
  heatmap and its table (``moe/expert_load/{heatmap,table}``,
  :class:`~depthmix.pretrain.callbacks.expert_heatmap.ExpertLoadHeatmap`).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shlex
import string

from depthmix.checkpoint.store import read_group, write_group, write_run_id
from depthmix.config import sweep
from depthmix.pretrain.callbacks.base import Callback
from depthmix.runtime.log import say, short_path

log = logging.getLogger("depthmix")


def default_name(run, point=None) -> str:
    """A multirun point: ``<model>-<mixer>-<key>=<value>...-<sweep id>`` with only the
    overrides that vary across the sweep. One run: ``<model>-<mixer>-<job>``, the job being
    the output directory's name, or its parent's when that name is just ``<model>_<mixer>``
    (e.g. ``3b-moda-slurm-4242``)."""
    if point is not None:
        return "-".join([run.model.name, run.mixer.name,
                         *(f"{k}={v}" for k, v in point.varying.items()), point.sweep_id])
    path = os.path.normpath(os.path.abspath(run.output_dir))
    job = os.path.basename(path)
    if job == f"{run.model.name}_{run.mixer.name}":
        job = os.path.basename(os.path.dirname(path))
    return f"{run.model.name}-{run.mixer.name}-{job}"


def default_group(run, point=None) -> str:
    """The sweep directory's name for a multirun point; ``run.name``, else the output
    directory below ``outputs/``, for one run."""
    if point is not None:
        return point.group
    if run.name:
        return run.name
    root = os.path.abspath("outputs")
    path = os.path.abspath(run.output_dir)
    if os.path.commonpath([root, path]) == root and path != root:
        return os.path.relpath(path, root)
    return os.path.basename(path)


def tags(run) -> list:
    """``model:<name>``, ``mixer:<name>``, then ``logger.tags``."""
    base = [f"model:{run.model.name}", f"mixer:{run.mixer.name}"]
    return base + [t for t in run.logger.tags if t not in base]


def _settings(wandb, verbose: bool):
    """No console capture; W&B prints only its errors unless ``train.verbose=true``
    (``silent`` / ``WANDB_SILENT`` would hide the errors too)."""
    if verbose:
        return wandb.Settings(console="off")
    return wandb.Settings(console="off", quiet=True, show_info=False, show_warnings=False)


class WandbLogger(Callback):
    def __init__(self):
        self.run = None  # the wandb Run, on the logging rank only
        self.directory = None  # its offline-run-<time>-<id> directory

    # ---- set-up -------------------------------------------------------------------------
    def _enabled(self, trainer) -> bool:
        lg = trainer.run.logger
        return lg.wandb and lg.mode != "disabled" and trainer.topo.is_logging_rank

    def setup(self, trainer) -> None:
        if not self._enabled(trainer):
            return
        import wandb

        from depthmix.config.load import to_container
        from depthmix.planning.flops import flops_per_token

        run, lg, topo = trainer.run, trainer.run.logger, trainer.topo
        state = trainer.state
        if state.run_id is None:  # W&B-style id; `secrets` leaves the seeded generators alone
            state.run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits)
                                   for _ in range(8))
            write_run_id(state.save_dir, state.run_id)
        run_id = state.run_id
        config = to_container(run)
        config["layout"] = {"world_size": topo.world_size, "tp": topo.tp, "pp": topo.pp,
                            "vp": topo.vp, "dp": topo.dp}
        config["flops_per_token"] = flops_per_token(run, trainer.mixer, trainer.config)
        config["resumed_from"] = state.resumed_from
        point = sweep.current()
        group = lg.group or read_group(state.save_dir) or default_group(run, point)
        write_group(state.save_dir, group)
        directory = lg.dir or run.output_dir
        os.makedirs(directory, exist_ok=True)
        settings = _settings(wandb, run.train.verbose)
        wandb.setup(settings=settings)  # its console output is configured here, not in init
        self.run = wandb.init(
            project=lg.project, entity=lg.entity, name=lg.name or default_name(run, point),
            dir=directory, mode=lg.mode, id=run_id, resume="allow", config=config,
            group=group, job_type=lg.job_type or "train", tags=tags(run), settings=settings,
        )
        self.directory = os.path.dirname(self.run.dir)  # .../offline-run-<time>-<id>
        say(f"W&B run {run_id} ({lg.mode}): {shlex.quote(short_path(self.directory))}")

    # ---- events -------------------------------------------------------------------------
    def post_step(self, trainer, result) -> None:
        from depthmix.runtime.device import memory_stats

        if result.perf is None or self.run is None:  # not a log step
            return
        data = {
            "train/loss": result.loss,
            "train/lr": result.lr,
            "train/loss_scale": result.loss_scale,
            "train/skipped": int(result.skipped is not None),
            "train/nonfinite_steps": result.nonfinite_steps,
            "train/consumed_samples": trainer.consumed_samples,
            "train/tokens": trainer.consumed_samples * trainer.run.model.seq_length,
            **result.perf.as_dict(),
            **memory_stats(),
        }
        if result.grad_norm is not None:
            data["train/grad_norm"] = result.grad_norm
        if result.experts is not None:
            data.update(result.experts.as_dict())
        self.run.log(data, step=trainer.step)

    def post_eval(self, trainer, result) -> None:
        if self.run is not None:
            self.run.log({"val/loss": result.loss, "val/ppl": math.exp(min(result.loss, 50))},
                         step=trainer.step)

    def log_depth_stats(self, trainer, stats) -> None:
        """:class:`~depthmix.pretrain.callbacks.depth_stats.DepthStats` as heatmaps, tables
        and scalars."""
        if self.run is None:
            return
        import wandb

        data = dict(stats.scalars)
        for name, matrix in stats.matrices.items():
            caption = f"{name} at step {stats.step}: rows = layers, columns = sources"
            data[f"depth/{name}/heatmap"] = wandb.Image(stats.images[name], caption=caption)
            columns = ["layer"] + [f"source{j}" for j in range(matrix.shape[1])]
            rows = [[u] + [None if math.isnan(v) else float(v) for v in matrix[u]]
                    for u in range(matrix.shape[0]) if not all(map(math.isnan, matrix[u]))]
            data[f"depth/{name}/table"] = wandb.Table(columns=columns, data=rows)
        if data:
            self.run.log(data, step=stats.step)

    def log_expert_load(self, trainer, heatmap) -> None:
        """:class:`~depthmix.pretrain.callbacks.expert_heatmap.ExpertHeatmap` as an image and
        a table (one row per MoE layer)."""
        if self.run is None:
            return
        import wandb

        share = heatmap.share
        columns = ["layer"] + [f"expert{e}" for e in range(share.shape[1])]
        rows = [[u] + [float(v) for v in share[u]] for u in range(share.shape[0])
                if not all(map(math.isnan, share[u]))]
        self.run.log({"moe/expert_load/heatmap": wandb.Image(heatmap.image,
                                                             caption=heatmap.caption),
                      "moe/expert_load/table": wandb.Table(columns=columns, data=rows)},
                     step=heatmap.step)

    # ---- shutdown -----------------------------------------------------------------------
    def _finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None

    def on_error(self, trainer, exc: BaseException) -> None:
        if not isinstance(exc, SystemExit) or exc.code not in (0, None):
            self._finish(exit_code=1)

    def close(self, trainer) -> None:
        self._finish()
