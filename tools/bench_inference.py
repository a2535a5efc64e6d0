#!/usr/bin/env python
"""Inference cost of each mixer next to vanilla: the Depth-Attention paper's Table 4.

Every model is built in one process and run round-robin (vanilla, mixer A, mixer B,
vanilla, ...): a KV-cached greedy prefill of ``--prefill`` tokens for ``--batch`` rows,
then ``--decode`` single-token steps. Reported per mixer (medians over ``--reps`` rounds;
ratios to vanilla are medians of same-round ratios, robust to machine drift):

* prefill time, decode time per token, total, and their ratio to vanilla;
* peak memory during prefill and during decode: on CUDA ``torch.cuda.max_memory_allocated``
  (weights included; each model is on the GPU only for its turn unless ``--resident``);
  on CPU, from an extra untimed pass under torch's ``MemTracker``
  (``torch.distributed._tools``: every tensor alive at the peak, weights included);
* persistent state per token: the bytes the KV cache holds after prefill per cached token
  and row, measured on the cache object (Depth-Attention keeps its mixed values in the V
  slot: no extra state over vanilla), and the transient depth state one token carries
  between layers in a forward (from the mixer's plan: the peak over layer boundaries of
  the live entries; vanilla carries ``h``);
* Block AttnRes: depth-source reads per token per forward, two-phase (the default through a
  KV cache) and per-sublayer (``attnres_block[plain]``, ``mixer.two_phase=false``).

    python tools/bench_inference.py          # CPU: tiny preset, batch 2, prefill 64, decode 16
    python tools/bench_inference.py --model 3b --batch 64 --prefill 2048 --decode 2048 \\
        --precision bf16 --reps 3                    # the paper's shape, on a GPU

Run time: the defaults (tiny preset, every mixer, 10 timed rounds plus an untimed memory
pass each) take about 35 s of CPU time: about a minute on an idle 2-core CPU, several
minutes on a loaded one (3 min measured at load 80). It grows with --reps x mixers x
(--prefill + --decode); ``--reps 1 --warmup 0`` is a smoke run.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

from tabulate import tabulate

from depthmix.cli.command import ArgumentParser, DefaultsFormatter
from depthmix.config.validate import PRECISIONS


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=DefaultsFormatter)
    p.add_argument("--mixers", default="all", help="comma list, or 'all' registered")
    p.add_argument("--impl", default="torch", help="mixer.impl for every mixer")
    p.add_argument("--model", default="tiny", help="model preset")
    p.add_argument("--layers", type=int, default=None, help="override num_layers")
    p.add_argument("--batch", type=int, default=2, help="rows per forward")
    p.add_argument("--prefill", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--decode", type=int, default=16, help="single-token decode steps")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="weights' dtype")
    p.add_argument("--reps", type=int, default=10, help="timed round-robin repetitions")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--no-plain-attnres", action="store_true",
                   help="skip the attnres_block[plain] row (per-sublayer reads)")
    p.add_argument("--option", action="append", default=[],
                   help="mixer option override, e.g. depth_attn.stride=2 (repeatable)")
    p.add_argument("--resident", action="store_true",
                   help="CUDA: keep every model on the GPU (default: each model is moved to "
                        "the GPU for its turn only, so 3B models plus a batch-64 cache fit)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help or a wrong option: answered before torch is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mixers import build_runs  # noqa: E402  (tools/ is not a package)

from depthmix.runtime.precision import torch_dtype  # noqa: E402


def build_models(args):
    """(label, model) in round-robin order: vanilla first."""
    from depthmix.pretrain.parallelize import init_distributed
    from depthmix.testing import build_model

    runs = build_runs(SimpleNamespace(
        mixers=args.mixers, impl=args.impl, model=args.model, option=args.option,
        micro_batch=args.batch, precision=args.precision, layers=args.layers,
        seq=args.prefill + args.decode, recompute=False, model_option=[], compile="eager"))
    labelled = []
    for name, _, run in runs:
        labelled.append((name, run))
        if name == "attnres_block" and not args.no_plain_attnres:
            plain = copy.deepcopy(run)
            plain.mixer.two_phase = False
            labelled.append(("attnres_block[plain]", plain))
    init_distributed(labelled[0][1])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    models = []
    for label, run in labelled:
        model = build_model(run, dtype=torch_dtype(args.precision)).eval()
        models.append((label, model.to(device) if args.resident else model))
    return models, device


def on_device(model, device, resident: bool):
    """The model on ``device`` for its turn (CUDA without ``--resident``: moved there and
    back to host memory afterwards, outside the timed region)."""
    if resident or device.type == "cpu":
        return model
    return model.to(device)


def off_device(model, device, resident: bool) -> None:
    if not resident and device.type == "cuda":
        model.to("cpu")
        torch.cuda.empty_cache()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def prefill_and_decode(model, prompt, decode: int, vocab: int, on_phase=None):
    """Greedy KV-cached run; ``on_phase(name)`` is called at the start of 'prefill', 'decode'
    and at 'end'. Returns the cache and the (prefill seconds, decode seconds)."""
    from depthmix.inference import KVCache

    cache = KVCache()
    on_phase = on_phase or (lambda name: None)
    _sync()
    on_phase("prefill")
    t0 = time.perf_counter()
    logits = model(prompt, inference=cache)[:, -1, :vocab]
    cache.advance(prompt.shape[1])
    _sync()
    on_phase("decode")
    t1 = time.perf_counter()
    for _ in range(decode):
        token = logits.argmax(-1, keepdim=True)
        logits = model(token, inference=cache)[:, -1, :vocab]
        cache.advance(1)
    _sync()
    t2 = time.perf_counter()
    on_phase("end")
    return cache, (t1 - t0, t2 - t1)


def cache_bytes(cache) -> int:
    """Bytes of the storages behind every tensor the KV cache holds (keys, values, any other
    per-layer state): a cached view keeping a larger tensor alive counts in full."""
    storages = {}
    for value in vars(cache).values():
        if isinstance(value, dict):
            for t in value.values():
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def depth_state_bytes_per_token(model, precision: str) -> int:
    """Peak over layer boundaries of the depth state one token carries (from the plan)."""
    size = torch_dtype(precision).itemsize
    plan = model.plan
    return max(sum(e.numel_per_token for e in plan.live_at(b)) * size
               for b in range(plan.num_layers + 1))


def cpu_peaks(model, prompt, decode: int, vocab: int):
    """Peak bytes of live tensors during prefill and during decode (torch's MemTracker);
    weights and, during decode, the KV cache built by the prefill are included."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def run_tracked(fn, *external):
        tracker = MemTracker()
        tracker.track_external(model, *external)
        with tracker:
            out = fn(tracker)
        return out, tracker.get_tracker_snapshot("peak")[prompt.device]["Total"]

    from depthmix.inference import KVCache

    cache = KVCache()

    def prefill(tracker):
        with torch.no_grad():
            return model(prompt, inference=cache)[:, -1, :vocab]

    logits, prefill_peak = run_tracked(prefill, prompt)
    cache.advance(prompt.shape[1])
    held = [t for d in (cache.keys, cache.values) for t in d.values()]

    def step_all(tracker):
        nonlocal logits
        with torch.no_grad():
            for _ in range(decode):
                logits = model(logits.argmax(-1, keepdim=True), inference=cache)[:, -1, :vocab]
                cache.advance(1)
                tracker.reset_mod_stats()  # per-module stats are per call; the peak stays

    _, decode_peak = run_tracked(step_all, logits, *held)
    return prefill_peak, decode_peak


def measure(args):
    models, device = build_models(args)
    vocab = models[0][1].config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.batch, args.prefill), generator=g).to(device)
    results = {label: {"prefill_s": [], "decode_s": [], "reads": {}} for label, _ in models}
    for rep in range(args.warmup + args.reps):
        for label, model in models:
            peaks = {}

            def on_phase(name, peaks=peaks):
                if not torch.cuda.is_available():
                    return
                if name != "prefill":  # the phase just finished
                    peaks[{"decode": "prefill", "end": "decode"}[name]] = \
                        torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()

            model = on_device(model, device, args.resident)
            cache, (t_pre, t_dec) = prefill_and_decode(model, prompt, args.decode, vocab,
                                                       on_phase)
            r = results[label]
            if rep >= args.warmup:
                r["prefill_s"].append(t_pre)
                r["decode_s"].append(t_dec)
            if rep == 0:
                tokens = args.batch * cache.offset
                r["cache_bytes_per_token"] = cache_bytes(cache) / tokens
                r["depth_state_bytes_per_token"] = depth_state_bytes_per_token(
                    model, args.precision)
                forwards = 1 + args.decode
                r["reads"] = {k: v / forwards for k, v in cache.counters.items()}
                r["params"] = sum(p.numel() for p in model.parameters())
            if peaks:
                r["prefill_peak_bytes"], r["decode_peak_bytes"] = peaks["prefill"], peaks["decode"]
            del cache
            off_device(model, device, args.resident)
    if not torch.cuda.is_available():  # untimed pass: MemTracker slows every op
        for label, model in models:
            pre, dec = cpu_peaks(model, prompt, args.decode, vocab)
            results[label]["prefill_peak_bytes"], results[label]["decode_peak_bytes"] = pre, dec
    base = results["vanilla"]
    for r in results.values():  # ratios: median over rounds of same-round ratios (drift-robust)
        totals = [p + d for p, d in zip(r["prefill_s"], r["decode_s"])]
        base_totals = [p + d for p, d in zip(base["prefill_s"], base["decode_s"])]
        r["ratio"] = {
            "prefill": statistics.median(a / b for a, b in zip(r["prefill_s"], base["prefill_s"])),
            "decode": statistics.median(a / b for a, b in zip(r["decode_s"], base["decode_s"])),
            "total": statistics.median(a / b for a, b in zip(totals, base_totals)),
        }
    for r in results.values():
        r["prefill_s"] = statistics.median(r["prefill_s"])
        r["decode_s_per_token"] = statistics.median(r["decode_s"]) / max(args.decode, 1)
        r["total_s"] = r["prefill_s"] + r["decode_s_per_token"] * args.decode
        del r["decode_s"]
    return results


def table(results) -> str:
    base = results["vanilla"]
    mib = 2.0**20
    head = ["mixer", "prefill ms", "decode ms/token", "total ms", "prefill ×", "decode ×",
            "total ×", "prefill peak MiB", "decode peak MiB", "KV cache B/token",
            "KV extra vs vanilla", "depth state B/token", "AttnRes reads/token"]
    rows = []
    for label, r in results.items():
        reads = r["reads"].get("attnres/source_reads")
        rows.append([
            label, f"{r['prefill_s'] * 1e3:.1f}", f"{r['decode_s_per_token'] * 1e3:.2f}",
            f"{r['total_s'] * 1e3:.1f}", f"{r['ratio']['prefill']:.2f}",
            f"{r['ratio']['decode']:.2f}", f"{r['ratio']['total']:.2f}",
            f"{r['prefill_peak_bytes'] / mib:.2f}", f"{r['decode_peak_bytes'] / mib:.2f}",
            f"{r['cache_bytes_per_token']:,.0f}",
            f"{r['cache_bytes_per_token'] - base['cache_bytes_per_token']:+,.0f}",
            f"{r['depth_state_bytes_per_token']:,}", "" if reads is None else f"{reads:g}"])
    return tabulate(rows, head, tablefmt="pipe", colalign=("left", *["right"] * 12),
                    disable_numparse=True)


def main(argv=None):
    from depthmix.cli.command import quiet_libraries

    args = parse_args(argv)
    with quiet_libraries():
        results = measure(args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device} | torch {torch.__version__} | model={args.model} batch={args.batch} "
          f"prefill={args.prefill} decode={args.decode} {args.precision} impl={args.impl} "
          f"| median of {args.reps}\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
