#!/usr/bin/env python
"""Kernel benchmarks: forward and forward+backward time and peak memory, side by side.

Each op ``depthmix/bench/<op>.py`` defines ``cases(smoke: bool)`` returning
:class:`Case` objects: a shape id, a function making fresh inputs, and candidates
(``ours`` = the Triton kernel, ``torch`` = our PyTorch path, ``compile`` = torch.compile of
it, and public kernels when importable). All candidates of a case run in one process, one
after another, and the table gives ratios to ``torch`` (or to the case's ``baseline``).

Timing: on CUDA ``triton.testing.do_bench`` (median of CUDA-event times over ``--rep-ms``
after ``--warmup-ms``, the L2 cache flushed before every call), on CPU
``torch.utils.benchmark.Timer.blocked_autorange`` (median over ``--rep-ms``; its block
estimate warms up); input gradients are cleared before each call. Peak memory: one call,
beyond its inputs. On a machine without CUDA only a smoke shape runs (through the Triton
interpreter when TRITON_INTERPRET=1): it checks the plumbing; CPU times say nothing about
GPU kernels.

    python tools/bench_kernels.py                     # all ops
    python tools/bench_kernels.py --ops attnres,mhc --rep-ms 500
    python tools/bench_kernels.py --ops depth_mix --cases T4096 --candidates ours,sdpa
    python tools/bench_kernels.py --check --cases T4096     # ours vs the fp32 reference
    python tools/bench_kernels.py --ops depth_mix --cases "op T16384-G4" --candidates ours \
        --profile 20 --trace traces/                       # where the time goes

``--check`` times nothing: for each case it runs ``ours`` and our PyTorch path (``torch``,
on the same inputs cast to fp32) once, forward and backward with the same output
gradients, and prints the largest ``||ours - ref|| / ||ref||`` over the outputs and over
the input gradients: on a GPU, the kernels' numerics at the benchmark shapes (the tests
check them in Triton's CPU interpreter at small shapes).

``--profile N`` makes no table: for each selected candidate the tool prints the wall time
of a forward + backward call (timed as the table times it), then runs N of them under
``torch.profiler`` (host and, on a GPU, device activity and Python stacks) and prints the
host time and kernel time per call under it and the operators by host time; ``--trace DIR``
also writes a Chrome trace per candidate (``chrome://tracing``, Perfetto).
"""

from __future__ import annotations

import os
import re
from typing import Callable, List, Optional, Tuple

from depthmix.cli.command import ArgumentParser, DefaultsFormatter


def parse_args():
    p = ArgumentParser(description=__doc__, formatter_class=DefaultsFormatter)
    p.add_argument("--ops", default="all", help="comma list, or 'all' registered")
    p.add_argument("--rep-ms", type=float, default=100,
                   help="time spent on the timed calls of each candidate (do_bench's rep)")
    p.add_argument("--warmup-ms", type=float, default=25,
                   help="CUDA: untimed calls first, for this long (do_bench's warmup)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (default without CUDA)")
    p.add_argument("--cases", default="",
                   help="comma list: run only cases whose 'op shape' label holds one of these")
    p.add_argument("--candidates", default="",
                   help="comma list of candidates to time ('ours' keeps 'ours+sdpa' too; each "
                        "case's baseline is kept)")
    p.add_argument("--check", action="store_true",
                   help="compare ours with the fp32 reference instead of timing")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N forward+backward iterations instead of timing")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: write a Chrome trace per candidate here")
    return p.parse_args()


if __name__ == "__main__":
    parse_args()  # --help or a wrong option: answered before torch is imported

import torch  # noqa: E402
from torch.utils import benchmark  # noqa: E402
from torch.utils._pytree import tree_leaves, tree_map  # noqa: E402

from depthmix import bench, kernels  # noqa: E402


def _outputs(out) -> List[torch.Tensor]:
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]


def _fwd_bwd(fn: Callable, args, kwargs) -> None:
    outs = _outputs(fn(*args, **kwargs))
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def measure(fn: Callable, make_inputs: Callable, backward: bool, rep_ms: float,
            warmup_ms: float) -> Tuple[float, int]:
    """Seconds of one call of ``fn`` (forward, or forward and backward), the median over
    ``rep_ms`` of calls on one set of inputs, and the bytes one call allocates at its peak
    beyond them (0 on CPU)."""
    args, kwargs = make_inputs()
    leaves = [t for t in tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.requires_grad]

    def call():
        for t in leaves:  # no gradient accumulation across calls
            t.grad = None
        _fwd_bwd(fn, args, kwargs) if backward else fn(*args, **kwargs)

    if not torch.cuda.is_available():
        timer = benchmark.Timer("call()", globals={"call": call},
                                num_threads=torch.get_num_threads())
        return timer.blocked_autorange(min_run_time=rep_ms / 1e3).median, 0
    from triton.testing import do_bench

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call()  # the peak, before do_bench allocates its L2-flush buffer
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return ms / 1e3, peak


def _as_fp32(tree):
    """The same inputs as fp32 leaves (floating tensors only), gradients kept."""
    return tree_map(lambda t: t.detach().float().requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def _relative_error(ours: List[torch.Tensor], ref: List[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(ours, ref):
        if a is None or b is None:
            continue
        b = b.float()
        worst = max(worst, ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item())
    return worst


def check(case) -> Tuple[float, float, int]:
    """``ours`` vs ``torch`` on fp32 copies of the same inputs: the worst relative error of
    the outputs, of the input gradients, and how many input gradients were compared."""
    torch.manual_seed(0)
    args, kwargs = case.make_inputs()
    results = []
    for name, inputs in (("ours", (args, kwargs)), ("torch", _as_fp32((args, kwargs)))):
        leaves = [t for t in tree_leaves(inputs)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        outs = _outputs(case.candidates[name](*inputs[0], **inputs[1]))
        if not results:
            gen = torch.Generator(device=outs[0].device).manual_seed(1)
            grads = [torch.randn(o.shape, generator=gen, device=o.device) for o in outs]
        torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs)])
        results.append(([o.detach() for o in outs], [t.grad for t in leaves]))
        for t in leaves:
            t.grad = None
    (out_a, grad_a), (out_b, grad_b) = results
    return _relative_error(out_a, out_b), _relative_error(grad_a, grad_b), len(grad_a)


def profile(label: str, fn: Callable, make_inputs: Callable, iters: int,
            trace_dir: Optional[str], rep_ms: float = 100, warmup_ms: float = 25) -> None:
    """The wall time of a forward+backward call (:func:`measure`), then ``iters`` such calls
    under ``torch.profiler``: host and kernel time per call, and the top operators."""
    from depthmix.pretrain.callbacks.profiler import profile_calls

    wall, _ = measure(fn, make_inputs, True, rep_ms, warmup_ms)
    args, kwargs = make_inputs()
    _fwd_bwd(fn, args, kwargs)  # first-call work (compiling, autotuning) stays out of the trace
    trace = (os.path.join(trace_dir, re.sub(r"[^\w.+-]+", "_", label) + ".json")
             if trace_dir else None)
    prof = profile_calls(lambda: _fwd_bwd(fn, args, kwargs), iters, trace)
    print(f"\n{label}: wall {wall * 1e3:.3f} ms a call; under the profiler: host "
          f"{prof.host_ms:.3f} ms, kernels {prof.kernel_ms:.3f} ms a call ({iters} calls)")
    print(prof.table.table(sort_by="self_cpu_time_total", row_limit=15,
                           max_name_column_width=60))
    if trace:
        print(f"trace: {trace}")


def _selected(case, patterns: List[str]) -> bool:
    return not patterns or any(p in f"{case.op} {case.shape}" for p in patterns)


def _wanted(name: str, keep: set) -> bool:
    """``--candidates``: a name matches by its parts (``ours`` keeps ``ours+sdpa``)."""
    return not keep or bool(keep & set(name.split("+")))


def main():
    args = parse_args()
    if args.ops == "all":
        args.ops = ",".join(kernels.ops())
    smoke = args.smoke or not torch.cuda.is_available()
    if not torch.cuda.is_available():  # before any kernel module is imported (triton.jit reads it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:  # `compile` candidates see one static shape per case; Dynamo's default of 8
        # recompiles per function would silently fall back to eager on the later cases
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    import triton

    print(f"{device} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{'smoke shapes' if smoke else 'full shapes'} | median over {args.rep_ms:g} ms "
          f"a candidate ({'do_bench, L2 flushed' if torch.cuda.is_available() else 'Timer'})")
    header = f"{'op':<16}{'shape':<34}{'candidate':<14}{'fwd ms':>9}{'f+b ms':>9}{'f+b/base':>10}{'peak MiB':>10}"
    patterns = [p for p in args.cases.split(",") if p]
    keep = {c for c in args.candidates.split(",") if c}
    if args.check:
        print("ours vs the fp32 reference: worst ||ours - ref|| / ||ref||")
    elif not args.profile:
        print(header)
    for op in args.ops.split(","):
        for case in bench.hooks(op).cases(smoke):
            if not _selected(case, patterns):
                continue
            if args.check:
                if {"ours", "torch"} <= set(case.candidates):
                    outputs, grads, n = check(case)
                    print(f"{op:<16}{case.shape:<34}outputs {outputs:.2e}  input grads "
                          f"{grads:.2e}  ({n} grads)", flush=True)
                continue
            if args.profile:
                for name, fn in case.candidates.items():
                    if _wanted(name, keep):
                        profile(f"{op} {case.shape} {name}", fn, case.make_inputs,
                                args.profile, args.trace, args.rep_ms, args.warmup_ms)
                continue
            results = {}
            for name, fn in case.candidates.items():
                if name != case.baseline and not _wanted(name, keep):
                    continue
                try:
                    fwd, _ = measure(fn, case.make_inputs, False, args.rep_ms, args.warmup_ms)
                    both, peak = measure(fn, case.make_inputs, True, args.rep_ms,
                                         args.warmup_ms)
                    results[name] = (fwd, both, peak)
                except Exception as e:  # a public kernel may refuse a shape; report it
                    results[name] = e.with_traceback(None)  # its frames hold the run's tensors
            ref = results.get(case.baseline)
            for name, r in results.items():
                if isinstance(r, Exception):
                    print(f"{op:<16}{case.shape:<34}{name:<14}  failed: {type(r).__name__}: {str(r)[:60]}")
                    continue
                ratio = r[1] / ref[1] if isinstance(ref, tuple) else float("nan")
                print(f"{op:<16}{case.shape:<34}{name:<14}{r[0] * 1e3:>9.3f}{r[1] * 1e3:>9.3f}"
                      f"{ratio:>10.3f}{r[2] / 2**20:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
