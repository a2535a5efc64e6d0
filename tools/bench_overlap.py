#!/usr/bin/env python
"""Training step time with and without overlapped data-parallel communication, side by side.

Run under torchrun, one process per GPU. Two trainers of the same run, one with
``parallel.overlap_grad_reduce`` / ``overlap_param_gather`` off and one with them on (the
parameter gather only with the distributed optimizer), step in alternation, so drift in
the machine hits both alike; rank 0 prints the median step time of each and their ratio.
Positional arguments are depthmix-train overrides.

    torchrun --standalone --nproc-per-node=8 tools/bench_overlap.py model=1p5b train=paper \\
        parallel=dp2_distopt train.global_batch_size=256 train.micro_batch_size=4
    torchrun --standalone --nproc-per-node=2 tools/bench_overlap.py --steps 3   # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

VARIANTS = {"off": "false", "on": "true"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="depthmix-train overrides, e.g. model=1p5b")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps (the first step's reductions never overlap: Megatron "
                        "learns the bucket order from it)")
    return p.parse_args()


def build(overrides: list, overlap: str):
    from depthmix.config.load import compose_run
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    run = compose_run("logger=none", *overrides, f"parallel.overlap_grad_reduce={overlap}",
                      f"parallel.overlap_param_gather={overlap}")
    if not run.parallel.distributed_optimizer:
        run.parallel.overlap_param_gather = False  # only the distributed optimizer gathers
    return Trainer(run, data=SyntheticData, callbacks=[])


def main():
    args = parse_args()
    from depthmix import runtime
    from depthmix.pretrain.parallelize import destroy_distributed
    from depthmix.runtime import log as run_log

    run_log.quiet_libraries(verbose=False)
    runtime.install()
    trainers = {name: build(args.overrides, value) for name, value in VARIANTS.items()}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = {name: [] for name in trainers}
    for step in range(args.warmup + args.steps):
        for name, trainer in trainers.items():
            sync()
            t0 = time.perf_counter()
            trainer.train_one_step()
            sync()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    first = trainers["off"]
    if first.topo.rank == 0:
        run, p = first.run, first.run.parallel
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        tokens = run.train.global_batch_size * run.model.seq_length
        print(f"\n{device} x {first.topo.world_size} | model={run.model.name} "
              f"mixer={run.mixer.name} {run.train.precision} | tp{p.tp} pp{p.pp} "
              f"dp{first.topo.dp} distributed_optimizer={p.distributed_optimizer} | "
              f"global batch {run.train.global_batch_size} x {run.model.seq_length} | "
              f"median of {args.steps} steps\n")
        base = statistics.median(times["off"])
        rows = [[name, f"{t * 1e3:.1f}", f"{t / base:.3f}",
                 f"{tokens / t / first.topo.world_size:,.0f}"]
                for name, t in ((n, statistics.median(m)) for n, m in times.items())]
        print(tabulate(rows, ["overlap", "ms/step", "ratio", "tokens/s/GPU"], tablefmt="plain",
                       colalign=("left", "right", "right", "right"), disable_numparse=True))
    destroy_distributed()


if __name__ == "__main__":
    main()
