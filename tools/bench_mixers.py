#!/usr/bin/env python
"""Training step time of each mixer relative to vanilla, measured side by side.

All models are built in one process and stepped round-robin (vanilla, mixer A, mixer B,
vanilla, ...), so drift in machine load hits every method alike; the table reports the
median step time and its ratio to vanilla's. CPU numbers are ratios only; absolute times
mean something on a GPU.

    python tools/bench_mixers.py                       # tiny model, every mixer, CPU
    python tools/bench_mixers.py --model 1p5b --layers 4 --seq 2048 --micro-batch 1 \\
        --precision bf16 --impl torch,triton           # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mixers", default="all", help="comma list, or 'all' registered")
    p.add_argument("--impl", default="torch", help="comma list of mixer.impl values")
    p.add_argument("--model", default="tiny", help="model preset")
    p.add_argument("--layers", type=int, default=None, help="override num_layers")
    p.add_argument("--seq", type=int, default=None, help="override seq_length")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--steps", type=int, default=8, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--option", action="append", default=[],
                   help="mixer option override, e.g. depth_attn.stride=2 (repeatable)")
    return p.parse_args()


# the tiny preset's 8 sublayers cannot hold Block AttnRes' default 12-sublayer block
TINY_OPTIONS = ["attnres_block.block_size=4"]


def build_runs(args):
    from depthmix.config.load import compose_run
    from depthmix.megatron_ext.mixers import available, get_mixer

    names = available() if args.mixers == "all" else args.mixers.split(",")
    if "vanilla" in names:
        names.remove("vanilla")
    names = ["vanilla", *names]
    impls = args.impl.split(",")
    options = {}
    given = {item.split("=", 1)[0] for item in args.option}
    defaults = [o for o in TINY_OPTIONS if o.split("=", 1)[0] not in given]
    for item in (defaults if args.model == "tiny" else []) + args.option:
        key, value = item.split("=", 1)
        mixer, field = key.split(".", 1)
        options.setdefault(mixer, []).append(f"mixer.{field}={value}")
    runs = []
    for name in names:
        for impl in (["torch"] if name == "vanilla" else impls):
            overrides = [f"model={args.model}", f"mixer={name}", "logger=none",
                         f"train.micro_batch_size={args.micro_batch}",
                         f"train.global_batch_size={args.micro_batch}",
                         f"train.precision={args.precision}", *options.get(name, [])]
            if name != "vanilla":
                overrides.append(f"mixer.impl={impl}")
            if args.layers:
                overrides.append(f"model.num_layers={args.layers}")
            if args.seq:
                overrides.append(f"model.seq_length={args.seq}")
            if args.recompute:
                overrides.append("parallel.recompute=full")
            run = compose_run(*overrides)
            get_mixer(name)  # fail early on unknown names
            runs.append((f"{name}", impl, run))
    return runs


def main():
    args = parse_args()
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    trainers = []
    for name, impl, run in build_runs(args):
        trainers.append((name, impl, Trainer(run, data=SyntheticData(run), callbacks=[])))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = {i: [] for i in range(len(trainers))}
    for step in range(args.warmup + args.steps):
        for i, (_, _, trainer) in enumerate(trainers):
            sync()
            t0 = time.perf_counter()
            trainer.train_one_step()
            sync()
            if step >= args.warmup:
                times[i].append(time.perf_counter() - t0)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    base = statistics.median(times[0])
    print(f"\n{device} | torch {torch.__version__} | model={args.model} "
          f"layers={trainers[0][2].run.model.num_layers} seq={trainers[0][2].run.model.seq_length} "
          f"micro_batch={args.micro_batch} {args.precision} | median of {args.steps} steps\n")
    print(f"{'mixer':<16}{'impl':<8}{'ms/step':>10}{'ratio':>8}{'params':>12}{'extra':>10}")
    vanilla_params = sum(p.numel() for p in trainers[0][2].model[0].parameters())
    for i, (name, impl, trainer) in enumerate(trainers):
        t = statistics.median(times[i])
        n = sum(p.numel() for p in trainer.model[0].parameters())
        print(f"{name:<16}{impl:<8}{t * 1e3:>10.1f}{t / base:>8.3f}{n:>12,}{n - vanilla_params:>10,}")


if __name__ == "__main__":
    main()
