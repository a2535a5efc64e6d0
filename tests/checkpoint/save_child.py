"""A single-process training that tests signal and kill from outside (``test_save_guard``).

    python save_child.py <run dir> <writer delay s>

Trains the tiny model with the default callbacks (checkpoints every 2 steps, preemption),
printing ``step N`` lines. With a delay, each of Megatron's forked checkpoint writers first
leaves ``<run dir>/writer_<pid>`` and sleeps that long: the save is then in progress, with
its helper processes alive, for as long as the test needs.
"""

import os
import sys
import time

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from depthmix import runtime
from depthmix.pretrain.trainer import Trainer, default_callbacks
from depthmix.testing import SyntheticData

from run_harness import make_run


def slow_writers(directory: str, delay: float) -> None:
    write = FileSystemWriterAsync.write_preloaded_data

    def slow(*args, **kwargs):
        open(os.path.join(directory, f"writer_{os.getpid()}"), "w").close()
        time.sleep(delay)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(slow)


def main() -> None:
    directory, delay = sys.argv[1], float(sys.argv[2])
    if delay:
        slow_writers(directory, delay)
    run = make_run(steps=10_000)
    run.output_dir = directory
    run.train.save_dir = os.path.join(directory, "checkpoints")
    run.train.save_interval = 2
    with runtime.installed():  # this process's entry point: helpers die with it, ...
        trainer = Trainer(run, data=SyntheticData, callbacks=default_callbacks(run))
        try:
            trainer.train()
        finally:
            trainer.close()


if __name__ == "__main__":
    main()
