"""``depthmix-eval``: a checkpoint's perplexity on token datasets, and lm-eval tasks.

    depthmix-eval eval.checkpoint=outputs/.../checkpoints \\
        eval.datasets={pile_val: /data/pile/val_text_document}
    torchrun --nproc-per-node 8 -m depthmix.evaluate.cli parallel=tp2_pp4 \\
        eval.checkpoint=/ckpt/3b_depth_attn eval.datasets={arxiv: /data/pile/val_ArXiv, ...}
    depthmix-eval eval.checkpoint=... eval.tasks=[piqa,sciq] eval.num_fewshot=5

The model and mixer come from the checkpoint (saved at any layout); the layout is the one
given here (``parallel=...``, TP/PP/DP through torchrun). Results: a JSON file (default
``<checkpoint>/eval/<eval.name>.json``), a table on the console, W&B with ``logger=...``.
See ``docs/evaluation.md``.

Exit status: 0 on success; 2 for a configuration error (a missing checkpoint, options that
disagree with it, a dataset shorter than one window, ...), found before any compute; 1 for
anything else.
"""

from __future__ import annotations

import os
import sys
import time

import hydra
from omegaconf import DictConfig

from depthmix.config.schema import ConfigError
from depthmix.config.store import register_configs
from depthmix.runtime import env as launch_env

launch_env.register_resolvers()


def run_job(job) -> dict:
    """Evaluate ``job`` (:class:`depthmix.evaluate.job.EvalJob`); collective. Rank 0 writes
    the JSON, prints the table and logs to W&B; every rank returns the results."""
    import torch.distributed as dist

    from depthmix.evaluate import report
    from depthmix.evaluate.job import harness
    from depthmix.evaluate.perplexity import evaluate_datasets

    start = time.perf_counter()
    tasks = None
    if job.eval.tasks:  # first: an unknown task fails before the perplexity pass
        from depthmix.inference.load import load_model

        ev = job.eval
        loaded = load_model(job.checkpoint, impl=job.run.mixer.impl, option="eval.checkpoint")
        tasks = harness()(loaded, list(ev.tasks), ev.num_fewshot, ev.batch_size, ev.limit,
                          include_path=ev.include_path)
        del loaded
    datasets = evaluate_datasets(job) if job.datasets else []
    results = report.results_dict(job, datasets, tasks, time.perf_counter() - start)
    if dist.get_rank() == 0:
        report.write_json(job.output, results)
        if tasks:
            from lm_eval.utils import make_table

            print(make_table(tasks), flush=True)
        if datasets:
            print(report.table(datasets), flush=True)
        print(f"results written to {job.output}", flush=True)
        run_id = report.log_wandb(job, results)
        if run_id:
            print(f"W&B run {run_id} ({job.run.logger.mode})", flush=True)
    return results


@hydra.main(config_path="../configs", config_name="evaluate", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from depthmix.evaluate.job import prepare
    from depthmix.pretrain.parallelize import destroy_distributed

    from depthmix.runtime.log import quiet_libraries, startup_warnings

    startup_warnings.start()  # Megatron's import-time notices and config dumps: held back,
    quiet_libraries(verbose=False)  # as in training
    launch_env.ensure_distributed_env()
    launch_env.quiet_nonzero_rank_logging(launch_env.launcher_rank())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        run_job(prepare(cfg, HydraConfig.get().overrides.task, world_size))
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        destroy_distributed()


def main() -> None:
    from depthmix.cli.train import _nonzero_rank_overrides

    register_configs()
    os.environ.setdefault("DEPTHMIX_RUN_KEY", launch_env.run_key())
    sys.argv.extend(_nonzero_rank_overrides())
    hydra_main()


if __name__ == "__main__":
    main()
