#!/usr/bin/env python
"""Checkpoint cost, side by side in one run: how long a save blocks the training loop,
synchronous (``train.async_save=false``) against asynchronous (background writer), how long
the background write takes until the checkpoint is published, and the load time (a full
resume: weights, optimizer, schedule, RNG).

One process, one rank; the model trains one step first so the optimizer state exists. Saves
alternate sync / async for ``--reps`` rounds, each into a fresh directory; medians are
reported with the machine and its load average (the numbers depend on both).

    python tools/bench_checkpoint.py                      # tiny and 8 layers x 1024 hidden
    python tools/bench_checkpoint.py --shapes 8x1024 --reps 5
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="tiny,8x1024",
                   help="comma list: 'tiny' (the test preset) or LAYERSxHIDDEN")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    return p.parse_args(argv)


def make_run(shape: str, out: str):
    from depthmix.testing import tiny_run

    run = tiny_run()
    if shape != "tiny":
        layers, hidden = (int(x) for x in shape.lower().split("x"))
        m = run.model
        m.num_layers, m.hidden_size, m.ffn_hidden_size = layers, hidden, hidden * 8 // 3
        m.num_attention_heads, m.num_query_groups = hidden // 64, hidden // 128
        m.vocab_size = 4096
    t = run.train
    t.micro_batch_size = t.global_batch_size = 1
    t.steps, t.eval_interval, t.save_interval = 1, 0, 0
    run.logger.wandb, run.logger.mode, run.logger.progress = False, "disabled", False
    run.output_dir, t.save_dir = out, os.path.join(out, "unused")
    return run


def bench(shape: str, reps: int, out: str) -> dict:
    from depthmix.checkpoint import guard
    from depthmix.checkpoint.background import BackgroundSaves
    from depthmix.pretrain.parallelize import destroy_model_parallel
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    trainer = Trainer(make_run(shape, out), data=SyntheticData, callbacks=[])
    trainer.train_one_step()
    saves = BackgroundSaves()
    sync, blocked, written, load, paths = [], [], [], [], []
    try:
        for i in range(reps):
            root = os.path.join(out, f"{shape}_sync_{i}")
            began = time.perf_counter()
            paths.append(trainer.save_checkpoint(root))
            sync.append(time.perf_counter() - began)

            root = os.path.join(out, f"{shape}_async_{i}")
            began = time.perf_counter()
            trainer.save_checkpoint(root, background=saves)
            blocked.append(time.perf_counter() - began)
            saves.wait()
            written.append(time.perf_counter() - began)

            began = time.perf_counter()
            trainer.load_checkpoint(paths[-1])
            load.append(time.perf_counter() - began)
        size = guard.dir_bytes(paths[-1])
        params = sum(p.numel() for chunk in trainer.model for p in chunk.parameters())
    finally:
        saves.abort()
        del trainer
        destroy_model_parallel()
    med = statistics.median
    return {"shape": shape, "params": params, "bytes": size, "sync": med(sync),
            "blocked": med(blocked), "written": med(written), "load": med(load)}


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tabulate import tabulate

    from depthmix import runtime
    from depthmix.planning.units import fmt_bytes
    from depthmix.testing import init_single_process

    out = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    rows = []
    with runtime.installed():
        init_single_process()
        load_before = os.getloadavg()
        for shape in args.shapes.split(","):
            rows.append(bench(shape, args.reps, out))
        load_after = os.getloadavg()
    if not args.dir:
        shutil.rmtree(out, ignore_errors=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{platform.system()}; load average (1/5/15 min) before "
          f"{'/'.join(f'{x:.2f}' for x in load_before)}, after "
          f"{'/'.join(f'{x:.2f}' for x in load_after)}; medians of {args.reps} rounds")
    head = ["shape", "params", "checkpoint", "sync save (blocks)", "async: blocks",
            "async / sync", "async: written after", "load (full resume)"]
    body = [[r["shape"], f"{r['params'] / 1e6:.1f} M", fmt_bytes(r["bytes"], "MiB", 0),
             f"{r['sync']:.3f} s", f"{r['blocked']:.3f} s", f"{r['blocked'] / r['sync']:.2f}",
             f"{r['written']:.3f} s", f"{r['load']:.3f} s"] for r in rows]
    print(tabulate(body, head, tablefmt="pipe", colalign=("left",) + ("right",) * 7,
                   disable_numparse=True))


if __name__ == "__main__":
    main()
