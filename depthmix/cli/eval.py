"""``depthmix-eval``: a checkpoint's perplexity on token datasets, and lm-eval tasks.

    depthmix-eval eval.checkpoint=outputs/.../checkpoints \\
        eval.datasets={pile_val: /data/pile/val_text_document}
    torchrun --nproc-per-node 8 -m depthmix.cli.eval parallel=tp2_pp4 \\
        eval.checkpoint=/ckpt/3b_depth_attn eval.datasets={arxiv: /data/pile/val_ArXiv, ...}
    depthmix-eval eval.checkpoint=... eval.tasks=[piqa,sciq] eval.num_fewshot=5

The model and mixer come from the checkpoint (saved at any layout); the layout is the one
given here (``parallel=...``, TP/PP/DP through torchrun). Results: a JSON file (default
``<checkpoint>/eval/<eval.name>.json``), a table on the console, W&B with ``logger=...``.
See ``docs/evaluation.md``. A configuration error (a missing checkpoint, options that
disagree with it, a dataset shorter than one window, ...) is found before any compute.
"""

from __future__ import annotations

import os
import sys
import textwrap
from typing import Optional

import hydra
from omegaconf import DictConfig

from depthmix import runtime
from depthmix.cli.command import HydraTask, command
from depthmix.config.store import register_configs
from depthmix.runtime import env as launch_env
from depthmix.runtime import exit_codes
from depthmix.runtime.log import quiet_libraries


@command
def evaluate(cfg: DictConfig) -> None:
    """One evaluation job (a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    quiet_libraries(verbose=False)  # Megatron's config dumps, as in training
    with runtime.installed():  # Megatron's import-time notices: held back, as in training
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
    options = ("Options: configs/evaluate.yaml (eval.*) and the training config groups; "
               "--cfg job prints the composed config, --hydra-help Hydra's own flags.")
    return "\n".join([__doc__.strip(), "", textwrap.fill(options, 88), "",
                      textwrap.fill(exit_codes.HELP, 88), ""])


@command
def main() -> Optional[int]:
    from depthmix.cli.train import _nonzero_rank_overrides

    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print(help_text())
        return exit_codes.OK
    register_configs()
    launch_env.register_resolvers()
    os.environ.setdefault("DEPTHMIX_RUN_KEY", launch_env.run_key())
    sys.argv.extend(_nonzero_rank_overrides())
    hydra_main()  # exits with the job's status when it is not 0
    return exit_codes.OK


if __name__ == "__main__":
    # `python -m depthmix.cli.eval`: run the importable module (see depthmix.cli.train)
    from depthmix.cli.eval import main as importable_main

    sys.exit(importable_main())
