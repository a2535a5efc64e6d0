"""``depthmix-eval``: a checkpoint's perplexity on token datasets, and lm-eval tasks.

    depthmix-eval eval.checkpoint=outputs/.../checkpoints \\
        eval.datasets={pile_val: /data/pile/val_text_document}
    torchrun --nproc-per-node 8 -m depthmix.cli.eval parallel=tp2_pp4 \\
        eval.checkpoint=/ckpt/3b_depth_attn eval.datasets={arxiv: /data/pile/val_ArXiv, ...}
    depthmix-eval eval.checkpoint=... eval.tasks=[piqa,sciq] eval.num_fewshot=5

The model and mixer come from the checkpoint (saved at any layout); the layout is the one
given here (``parallel=...``, TP/PP/DP through torchrun). Results: a JSON file (default
``<checkpoint>/eval/<eval.name>.json``), a table on the console, W&B with ``logger=...``;
the log (``<eval.name>.log``, or the results file's name with ``.log``) and the W&B folder
go beside the results file. See ``docs/evaluation.md``. A typo'd option, a missing
checkpoint, dataset or task folder is reported before torch is imported; options that
disagree with the checkpoint, a dataset shorter than one window, ... before any compute.
"""

from __future__ import annotations

import os
import sys
import textwrap
from typing import Optional

import hydra
from omegaconf import DictConfig

from depthmix.cli.command import (
    HydraTask,
    command,
    hydra_quote,
    quiet_libraries,
    require_checkpoint,
    require_path,
    require_writable_dir,
)
from depthmix.config.store import register_configs
from depthmix.runtime import env as launch_env
from depthmix.runtime import exit_codes


@command
def evaluate(cfg: DictConfig) -> None:
    """One evaluation job (a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    with quiet_libraries():  # Megatron's config dumps and import-time notices
        from depthmix.evaluate.job import prepare, run_job
        from depthmix.pretrain.parallelize import destroy_distributed

        launch_env.ensure_distributed_env()
        launch_env.quiet_nonzero_rank_logging(launch_env.launcher_rank())
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        try:
            run_job(prepare(cfg, HydraConfig.get().overrides.task, world_size))
        finally:
            destroy_distributed()


job = HydraTask(evaluate)
"""What Hydra runs per job (and a submitit job unpickles)."""
hydra_main = hydra.main(config_path="../configs", config_name="evaluate", version_base=None)(job)


def help_text() -> str:
    from depthmix.cli.overrides import _describe, schema_options

    options = ("Options: eval.* below (configs/eval/default.yaml) and the training config "
               "groups (depthmix-train --help); --cfg job prints the composed config, "
               "--hydra-help Hydra's own flags.")
    return "\n".join([__doc__.strip(), "", textwrap.fill(options, 88), "",
                      "eval options (eval.<option>=value):", *_describe("eval.",
                                                                       schema_options("eval")),
                      "", textwrap.fill(exit_codes.HELP, 88), ""])


def check_inputs(cfg: DictConfig) -> str:
    """The paths an evaluation reads, before anything heavy is imported: the checkpoint
    (returned: the ``iter_*`` directory), each dataset prefix and the task folder."""
    ev = cfg.eval
    found = require_checkpoint(ev.checkpoint, "eval.checkpoint")
    datasets = ev.datasets if isinstance(ev.datasets, DictConfig) else {}
    for name, prefix in datasets.items():
        if isinstance(prefix, str):
            require_path(prefix, f"eval.datasets.{name}", "prefix")
    if ev.include_path:
        require_path(ev.include_path, "eval.include_path", "dir")
    return found


def placement(cfg: DictConfig, checkpoint: str, argv) -> list:
    """Hydra overrides that put the job's log (``<results name>.log``) and its W&B folder
    beside the results file, and no ``.hydra`` folder; none when ``hydra.run.dir`` is set."""
    if any(a.startswith("hydra.run.dir=") for a in argv):
        return []
    ev = cfg.eval
    results = ev.output or os.path.join(checkpoint, "eval", f"{ev.name}.json")
    require_writable_dir(os.path.dirname(os.path.abspath(results)),
                         "eval.output" if ev.output else "eval.name")
    stem = os.path.splitext(os.path.basename(results))[0]
    return [f"hydra.run.dir={hydra_quote(os.path.dirname(os.path.abspath(results)))}",
            "hydra.output_subdir=null", f"hydra.job.name={hydra_quote(stem)}"]


@command
def main() -> Optional[int]:
    from depthmix.cli.overrides import hydra_points
    from depthmix.cli.train import _nonzero_rank_overrides

    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return exit_codes.OK
    register_configs()
    launch_env.register_resolvers()
    points = hydra_points(argv, "evaluate") or []
    for point in points:
        checkpoint = check_inputs(point.cfg)
    extra = _nonzero_rank_overrides()
    if len(points) == 1 and "-m" not in argv and "--multirun" not in argv:
        extra += [o for o in placement(points[0].cfg, checkpoint, argv) if o not in extra]
    os.environ.setdefault("DEPTHMIX_RUN_KEY", launch_env.run_key())
    sys.argv.extend(extra)
    hydra_main()  # exits with the job's status when it is not 0
    return exit_codes.OK


if __name__ == "__main__":
    # `python -m depthmix.cli.eval`: run the importable module (see depthmix.cli.train)
    from depthmix.cli.eval import main as importable_main

    sys.exit(importable_main())
