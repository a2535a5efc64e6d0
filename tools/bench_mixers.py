#!/usr/bin/env python
"""Training step time of each mixer relative to vanilla, measured side by side.

All models are built in one process and stepped round-robin (vanilla, mixer A, mixer B,
vanilla, ...), so drift in machine load hits every method alike; the table reports the
median step time and its ratio to vanilla's, tokens/s, and on a GPU the MFU as the trainer's
log line counts it (``depthmix.planning.flops``: attention over the whole score square, as
Megatron-LM counts it). CPU numbers are ratios only; absolute times mean something on a GPU.

    python tools/bench_mixers.py                       # tiny model, every mixer, CPU
    python tools/bench_mixers.py --model tiny_moe      # the same over experts (docs/moe.md)
    python tools/bench_mixers.py --model 1p5b --layers 4 --seq 2048 --micro-batch 1 \\
        --precision bf16 --impl torch,triton           # on a GPU
    python tools/bench_mixers.py --compile both --peers  # + compiled rows, peer models
    python tools/bench_mixers.py --profile 3 --trace traces/  # host vs GPU time per step
    python tools/bench_mixers.py --peers-only --layers 8 --seq 512 --micro-batch 2 \
        --model-option hidden_size=512 --model-option ffn_hidden_size=1408 \
        --model-option num_attention_heads=8 --model-option num_query_groups=4 \
        --steps 20 --clock cpu                         # ours vs HF Qwen3, CPU (issue 44)

``--compile both`` adds a compiled row (``train.compile=true``) per mixer, with its ratio to
eager vanilla and to compiled vanilla, the graphs Dynamo compiled for it (its distinct
layer bodies, with and without gradients), its graph breaks and its compile time (the
first step less a compiled step). ``--peers`` times one forward+backward (no optimizer)
of our vanilla model, Megatron-Core's own ``GPTModel`` (local spec) and, when
``transformers`` is installed, Hugging Face's ``Qwen3ForCausalLM``, all at the same
Qwen3-style shape, side by side: each a bare module (ours without the DDP wrapper, whose
gradient hooks add every gradient into the flat buffer, work the peers do not do), in
rounds (every model once, in turn); the table gives each one's median time, its ratio
to ours and the median of its per-round ratios. ``--peers-only`` times the peers alone
(no training steps of the mixers first).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter

from tabulate import tabulate

from depthmix.cli.command import ArgumentParser, DefaultsFormatter
from depthmix.config.validate import PRECISIONS


def parse_args():
    p = ArgumentParser(description=__doc__, formatter_class=DefaultsFormatter)
    p.add_argument("--mixers", default="all", help="comma list, or 'all' registered")
    p.add_argument("--impl", default="torch", help="comma list of mixer.impl values")
    p.add_argument("--model", default="tiny", help="model preset")
    p.add_argument("--layers", type=int, default=None, help="override num_layers")
    p.add_argument("--seq", type=int, default=None, help="override seq_length")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--steps", type=int, default=8, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--option", action="append", default=[],
                   help="mixer option override, e.g. depth_attn.stride=2 (repeatable)")
    p.add_argument("--model-option", action="append", default=[],
                   help="model option override, e.g. hidden_size=512 (repeatable)")
    p.add_argument("--compile", default="eager", choices=["eager", "compiled", "both"],
                   help="train.compile=false, true, or one row of each per mixer")
    p.add_argument("--peers", action="store_true",
                   help="also time Megatron-Core's GPTModel and HF Qwen3 at the same shape")
    p.add_argument("--peers-only", action="store_true",
                   help="only the peer comparison (vanilla's shape; no training steps)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="the peers' clock: wall time, or this thread's CPU time with one "
                        "intra-op thread (robust to other processes on a shared CPU)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then profile N more steps of each model: host and GPU kernel time")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: a Chrome trace per model here")
    return p.parse_args()


if __name__ == "__main__":
    parse_args()  # --help or a wrong option: answered before torch is imported

import torch  # noqa: E402


# the tiny presets' 8 sublayers cannot hold Block AttnRes' default 12-sublayer block
TINY_OPTIONS = ["attnres_block.block_size=4"]
TINY_PRESETS = ("tiny", "tiny_moe")


def build_runs(args):
    from depthmix.config.load import compose_run
    from depthmix.mixers import available, get_mixer

    names = available() if args.mixers == "all" else args.mixers.split(",")
    if "vanilla" in names:
        names.remove("vanilla")
    names = ["vanilla", *names]
    impls = args.impl.split(",")
    options = {}
    given = {item.split("=", 1)[0] for item in args.option}
    defaults = [o for o in TINY_OPTIONS if o.split("=", 1)[0] not in given]
    for item in (defaults if args.model in TINY_PRESETS else []) + args.option:
        key, value = item.split("=", 1)
        mixer, field = key.split(".", 1)
        options.setdefault(mixer, []).append(f"mixer.{field}={value}")
    runs = []
    modes = {"eager": ["false"], "compiled": ["true"], "both": ["false", "true"]}[args.compile]
    for name, impl, compiled in ((n, i, c) for n in names for c in modes
                                 for i in (["torch"] if n == "vanilla" else impls)):
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
        overrides += [f"model.{o}" for o in args.model_option]
        overrides.append(f"train.compile={compiled}")
        run = compose_run(*overrides)
        get_mixer(name)  # fail early on unknown names
        runs.append((name, impl if compiled == "false" else f"{impl}+c", run))
    return runs


def print_peers(vanilla_trainer, args) -> None:
    from depthmix.bench.peers import forward_backward_rounds, peer_models, round_ratios
    from depthmix.pretrain.parallelize import build_chunks

    run = vanilla_trainer.run
    # a bare chunk as the peers are bare modules (the trainer's is wrapped in Megatron's DDP)
    ours = build_chunks(run, vanilla_trainer.mixer, vanilla_trainer.config,
                        vanilla_trainer.topo)[0]
    device = next(ours.parameters()).device
    x = torch.randint(0, run.model.vocab_size, (args.micro_batch, run.model.seq_length),
                      device=device)
    pos = torch.arange(run.model.seq_length, device=device).expand_as(x)
    models = [("depthmix vanilla", ours, lambda x, pos: ours(x, pos, labels=x).sum())]
    models += [(n, m.to(device), f)
               for n, m, f in peer_models(run, vanilla_trainer.config.kv_channels)]
    clock = time.perf_counter
    if args.clock == "cpu":  # every op on this thread, so its CPU time is all the work
        torch.set_num_threads(1)
        clock = time.thread_time
    times = forward_backward_rounds(models, (x, pos), args.steps, args.warmup, clock)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratios = round_ratios(times, "depthmix vanilla")
    base = medians["depthmix vanilla"]
    print(f"\nforward+backward, same shape, {args.steps} rounds after {args.warmup} "
          f"(no optimizer; {args.clock} clock, torch threads {torch.get_num_threads()})\n")
    rows = [[name, f"{medians[name] * 1e3:.1f}", f"{medians[name] / base:.3f}",
             f"{ratios[name]:.3f}", f"{sum(p.numel() for p in model.parameters()):,}"]
            for name, model, _ in models]
    print(tabulate(rows, ["model", "ms", "ratio", "per round", "params"], tablefmt="plain",
                   colalign=("left", "right", "right", "right", "right"), disable_numparse=True))


def print_profiles(trainers, times, args) -> None:
    """Each model's step under ``torch.profiler``: is it the host or the GPU that sets the
    pace (a step whose host time exceeds its kernel time waits on Python and launches)?"""
    from depthmix.pretrain.callbacks.profiler import profile_calls

    print(f"\nunder torch.profiler, {args.profile} steps each (the profiler adds host time)\n")
    rows = []
    for i, (name, impl, trainer) in enumerate(trainers):
        trace = os.path.join(args.trace, f"{name}_{impl}.json") if args.trace else None
        prof = profile_calls(trainer.train_one_step, args.profile, trace)
        rows.append([name, impl, f"{statistics.median(times[i]) * 1e3:.1f}",
                     f"{prof.host_ms:.1f}", f"{prof.kernel_ms:.1f}"])
    print(tabulate(rows, ["mixer", "impl", "ms/step", "host ms", "kernel ms"], tablefmt="plain",
                   colalign=("left", "left", "right", "right", "right"), disable_numparse=True))


def _dynamo_counts() -> Counter:
    """Graphs Dynamo has compiled and graph breaks it has taken so far in this process."""
    from torch._dynamo.utils import counters

    return Counter(graphs=counters["stats"]["unique_graphs"],
                   breaks=sum(counters["graph_break"].values()))


def main():
    args = parse_args()
    from depthmix import runtime
    from depthmix.runtime import log as run_log

    run_log.quiet_libraries(verbose=False)
    runtime.install()  # this process's patches; Megatron's import-time notices held back
    from depthmix.planning.flops import device_peak_tflops, flops_per_token
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    trainers = []
    for name, impl, run in build_runs(args):
        trainers.append((name, impl, Trainer(run, data=SyntheticData(run), callbacks=[])))
        if args.peers_only:
            return print_peers(trainers[0][2], args)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = {i: [] for i in range(len(trainers))}
    first_step = {}
    # what Dynamo did while each trainer stepped: compiled graphs, graph breaks
    dynamo = {i: Counter() for i in range(len(trainers))}
    for step in range(args.warmup + args.steps):
        for i, (_, _, trainer) in enumerate(trainers):
            before = _dynamo_counts()
            sync()
            t0 = time.perf_counter()
            trainer.train_one_step()
            sync()
            elapsed = time.perf_counter() - t0
            dynamo[i].update(_dynamo_counts() - before)
            first_step.setdefault(i, elapsed)
            if step >= args.warmup:
                times[i].append(elapsed)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    base = statistics.median(times[0])
    print(f"\n{device} | torch {torch.__version__} | model={args.model} "
          f"layers={trainers[0][2].run.model.num_layers} seq={trainers[0][2].run.model.seq_length} "
          f"micro_batch={args.micro_batch} {args.precision} | median of {args.steps} steps\n")
    compiled_base = next((statistics.median(times[i]) for i, (n, impl, _) in enumerate(trainers)
                          if n == "vanilla" and impl.endswith("+c")), None)
    compiled_rows = any(impl.endswith("+c") for _, impl, _ in trainers)
    head = ["mixer", "impl", "ms/step", "ratio", "vs same", "tokens/s", "MFU", "params", "extra"]
    head += ["graphs", "breaks", "compile s"] if compiled_rows else []
    rows = []
    vanilla_params = sum(p.numel() for p in trainers[0][2].model[0].parameters())
    peak = device_peak_tflops(trainers[0][2].run, device if torch.cuda.is_available() else None)
    for i, (name, impl, trainer) in enumerate(trainers):
        t = statistics.median(times[i])
        same = compiled_base if impl.endswith("+c") else base  # compiled vs compiled vanilla
        n = sum(p.numel() for p in trainer.model[0].parameters())
        tokens_per_s = args.micro_batch * trainer.run.model.seq_length / t
        # the trainer's own count (depthmix.planning.flops): what its log line's MFU reads
        flops = flops_per_token(trainer.run, trainer.mixer, trainer.config)["train"]
        tflops = flops * tokens_per_s / 1e12
        row = [name, impl, f"{t * 1e3:.1f}", f"{t / base:.3f}", f"{t / same:.3f}",
               f"{tokens_per_s:,.0f}", f"{tflops / peak:.1%}" if peak else "-", f"{n:,}",
               f"{n - vanilla_params:,}"]
        if impl.endswith("+c"):  # compile time: the first step less a compiled step
            row += [str(dynamo[i]["graphs"]), str(dynamo[i]["breaks"]),
                    f"{first_step[i] - t:.1f}"]
        rows.append(row)
    print(tabulate(rows, head, tablefmt="plain", colalign=("left", "left", *["right"] * 10),
                   disable_numparse=True))
    if args.peers:
        print_peers(trainers[0][2], args)
    if args.profile:
        print_profiles(trainers, times, args)


if __name__ == "__main__":
    main()
