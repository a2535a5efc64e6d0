"""``depthmix-train``: parse the Hydra config, build, train, close.

    depthmix-train model=tiny mixer=depth_attn
    torchrun --nproc-per-node 8 -m depthmix.pretrain.train model=3b mixer=moda parallel=tp2_pp4
    depthmix-train -m mixer=depth_attn mixer.stride=6,12,24
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from depthmix.config.load import resolve
from depthmix.config.store import register_configs
from depthmix.pretrain.trainer import Trainer, default_callbacks


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    run = resolve(cfg)
    trainer = Trainer(run, callbacks=default_callbacks(run))
    try:
        trainer.train()
    except BaseException as exc:
        trainer.on_error(exc)
        raise
    finally:
        trainer.close()


def main() -> None:
    register_configs()
    hydra_main()


if __name__ == "__main__":
    main()
