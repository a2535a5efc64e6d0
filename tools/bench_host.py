#!/usr/bin/env python
"""Host cost of a training step per layer, per mixer: a CPU proxy for a host-bound GPU step.

At tiny widths (hidden 64, sequence 16, micro-batch 1, 8 layers) the CPU's kernel time is
small next to what every op costs the host (Python, autograd, the dispatcher, allocations),
which is what a GPU step at the 1.5B shapes waits on. For each mixer, ``mixer.impl`` and
``train.compile`` it reports, per layer and training step, split into forward, backward and
optimizer (Megatron's ``forward_step`` / ``backward_step``, our ``optimizer_step``):

* **host µs**: the phase's time divided by the layers, median over the timed steps; by
  default the thread's CPU time (``--clock cpu``: other processes on a shared machine
  barely move it), or wall time (``--clock wall``; both are in the JSON). The CPU kernels'
  time is minimised by the shapes, not removed: a proxy;
* **ATen calls**: the ops the dispatcher runs, counted by a ``TorchDispatchMode`` over
  separate steps (compiled layers run compiled under it: the mode ignores compilation and
  sees what the compiled graphs call at run time; ops inside our custom ops, such as a
  launcher's allocations, count too).

What is not a GPU run's is taken out: with ``impl=triton`` the kernels' launches are
no-ops (Triton's interpreter would otherwise be the whole time): everything up to the
launch runs (checks, allocations, the autograd and custom-op machinery, the launchers' tile
choice), the launch does not, so the host time of a GPU launch (Triton's argument binding
and ``cuLaunchKernel``, a few µs) is left out; each launch zero-fills its tensor arguments
instead, so the step stays finite, and the fills are neither counted nor timed (their time
is taken out of the phase they fall in: :class:`FillTime`). Forward and backward run without the CPU
shim's ``TorchFunctionMode`` (the optimizer keeps it: Megatron allocates on ``"cuda"`` by
name there). Every step applies its update and clips (``train.clip_grad=1e-6``: whether a
step clips depends on values the no-op launches zero). All models are built in one process
and stepped in turn; compiled layers keep their bodies in Dynamo caches of their own model
(:func:`depthmix.pretrain.compile.body_groups`), so models side by side do not pay for each
other's guards.

    python tools/bench_host.py                                  # every mixer, all four modes
    python tools/bench_host.py --mixers vanilla,mhc --compile eager --json host.json
    python tools/bench_host.py --ops-only                       # custom op vs autograd.Function

A mixer without kernels (DenseFormer) gets no ``impl=triton`` row: it runs the same
code. ``--ops-only`` (also printed after the table unless ``--no-ops``) times one forward +
backward of each kernel op through the two entry points of
:class:`depthmix.kernels._common.KernelOp`: the ``torch.library`` custom op (what compiled
graphs call) and the plain ``autograd.Function`` eager code uses, at one token, launches
no-ops.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections import Counter

from tabulate import tabulate

from depthmix.cli.command import ArgumentParser, DefaultsFormatter

PHASES = ("forward", "backward", "optimizer")
CLOCKS = ("wall", "cpu")
CLOCK_FUNCTIONS = {"wall": time.perf_counter, "cpu": time.thread_time}


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=DefaultsFormatter)
    p.add_argument("--mixers", default="all", help="comma list, or 'all' registered")
    p.add_argument("--impl", default="torch,triton", help="comma list of mixer.impl values")
    p.add_argument("--compile", default="both", choices=["eager", "compiled", "both"],
                   help="train.compile=false, true, or a row of each")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4, help="attention heads (2 KV groups)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    p.add_argument("--count-steps", type=int, default=1, help="steps counted for ATen calls")
    p.add_argument("--clock", default="cpu", choices=CLOCKS,
                   help="host time in the table: the thread's CPU time (robust to other "
                        "processes on the machine) or wall time (both in the JSON)")
    p.add_argument("--option", action="append", default=[],
                   help="mixer option override, e.g. depth_attn.stride=2 (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="run config override for every model, e.g. "
                        "train.fused_optimizer=true (repeatable)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")
    p.add_argument("--ops-only", action="store_true",
                   help="only the custom op vs autograd.Function comparison")
    p.add_argument("--no-ops", action="store_true", help="skip that comparison")
    p.add_argument("--op-reps", type=int, default=50, help="calls per op and round")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help or a wrong option: answered before torch is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")  # impl=triton on CPU (launches no-ops)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


# ---- counting and launching nothing -------------------------------------------------------
class AtenCounter(TorchDispatchMode):
    """Counts the ops the dispatcher runs, per phase (:attr:`phase`). A ``depthmix::``
    custom op counts once and so do the ops its host code issues (the mode is re-entered
    for its body). Compiled code runs compiled under it (``ignore_compile_internals``)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self.ops = Counter()
        self.phase = "other"

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counts[self.phase] += 1
        self.ops[(self.phase, str(func))] += 1
        if func.namespace == "depthmix":
            keys = _backend_keys(args)
            if keys is not None:
                with self:
                    return func.redispatch(keys, *args, **kwargs)
        return func(*args, **kwargs)


def _backend_keys(args):
    """The dispatch keys below the Python key of the first tensor among ``args``."""
    for a in args:
        t = a[0] if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) else a
        if isinstance(t, torch.Tensor):
            return torch._C._dispatch_keys(t) & torch._C._dispatch_keyset_full_after(
                torch._C.DispatchKey.Python)
    return None


class FillTime:
    """Seconds spent zero-filling in place of launches (:func:`no_kernel_launches`), on
    both clocks: :class:`Phases` takes them out of the phase it falls in, as no GPU run
    has them."""

    def __init__(self):
        self.wall = self.cpu = 0.0


@contextlib.contextmanager
def no_kernel_launches(zero_fill: bool = True):
    """Every Triton ``kernel[grid](...)`` a no-op that zero-fills its floating tensor
    arguments, inputs too (the outputs are uninitialised allocations: zeros keep the step
    finite), outside any dispatch mode (neither counted nor timed as ATen calls of ours:
    yields the :class:`FillTime` that sums the fills' time). The attnres backward writes
    its source gradients through a pointer table: those are zeroed after its launcher
    returns."""
    from unittest import mock

    from triton.runtime.jit import KernelInterface
    from torch.utils._python_dispatch import _disable_current_modes

    from depthmix.kernels.attnres import function as attnres

    spent = FillTime()

    def zero(tensors):
        w0, c0 = time.perf_counter(), time.thread_time()
        with _disable_current_modes(), torch.no_grad():
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    t.data.zero_()  # .data: autograd's version counters untouched
        spent.wall += time.perf_counter() - w0
        spent.cpu += time.thread_time() - c0

    def fill(*args, **kwargs):
        if zero_fill:
            zero(t for a in (*args, *kwargs.values())
                 for t in (a if isinstance(a, (list, tuple)) else (a,)))

    launcher = attnres.attnres_bwd

    def attnres_bwd(*args, **kwargs):
        grads = launcher(*args, **kwargs)
        if zero_fill:
            zero(grads[0])
        return grads

    with mock.patch.object(KernelInterface, "__getitem__", lambda self, grid: fill), \
            mock.patch.object(attnres, "attnres_bwd", attnres_bwd):
        yield spent


# ---- one model per row --------------------------------------------------------------------
def build_run(mixer: str, impl: str, compiled: bool, args):
    from depthmix.config.load import compose_run

    overrides = [
        "model=tiny", f"mixer={mixer}", "logger=none",
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.ffn_hidden_size={args.hidden * 11 // 4}",
        f"model.num_attention_heads={args.heads}", "model.num_query_groups=2",
        f"model.seq_length={args.seq}", "model.vocab_size=256",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}", "train.precision=fp32",
        f"train.compile={'true' if compiled else 'false'}",
        # every step clips: whether one would depends on values, which the no-op kernel
        # launches zero
        "train.clip_grad=1e-6",
    ]
    if mixer != "vanilla":
        overrides.append(f"mixer.impl={impl}")
    overrides += args.set
    for item in args.option:
        key, value = item.split("=", 1)
        name, field = key.split(".", 1)
        if name == mixer:
            overrides.append(f"mixer.{field}={value}")
    return compose_run(*overrides)


class Phases:
    """Times and labels the phases of a training step: Megatron's ``forward_step`` and
    ``backward_step`` (patched in its schedules module) and our ``optimizer_step``, less
    the time ``fills`` (a :class:`FillTime`) counts in them."""

    def __init__(self, fills: "FillTime | None" = None):
        self.wall, self.cpu = Counter(), Counter()  # seconds per phase in the current step
        self.counter = None
        self.fills = fills or FillTime()

    def clear(self):
        self.wall.clear()
        self.cpu.clear()

    @contextlib.contextmanager
    def installed(self):
        from unittest import mock

        from megatron.core.pipeline_parallel import schedules

        from depthmix.pretrain import step

        wrapped = [(schedules, "forward_step", "forward"), (schedules, "backward_step", "backward"),
                   (step, "optimizer_step", "optimizer")]
        with contextlib.ExitStack() as stack:
            for module, name, phase in wrapped:
                stack.enter_context(
                    mock.patch.object(module, name, self._wrap(phase, getattr(module, name))))
            yield self

    def _wrap(self, phase, fn):
        shimless = phase != "optimizer"

        def timed(*args, **kwargs):
            counter = self.counter
            if counter is not None:
                before, counter.phase = counter.phase, phase
            with without_cpu_shim() if shimless else contextlib.nullcontext():
                fills = self.fills
                w0, c0 = time.perf_counter() - fills.wall, time.thread_time() - fills.cpu
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.wall[phase] += time.perf_counter() - fills.wall - w0
                    self.cpu[phase] += time.thread_time() - fills.cpu - c0
                    if counter is not None:
                        counter.phase = before
        return timed


@contextlib.contextmanager
def without_cpu_shim():
    """The CPU shim's ``TorchFunctionMode`` (``depthmix.runtime.cpu``: Megatron's
    ``device="cuda"`` to the CPU) off: it intercepts every torch call in Python, a cost no
    GPU run has. Forward and backward run without it; Megatron's optimizer allocates on
    ``"cuda"`` by name and keeps it."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    from depthmix.runtime.cpu import _CudaToCpuMode

    if isinstance(_get_current_function_mode(), _CudaToCpuMode):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def build(mixer: str, impl: str, compiled: bool, args):
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    run = build_run(mixer, impl, compiled, args)
    trainer = Trainer(run, data=SyntheticData(run), callbacks=[])
    trainer.health.check = lambda loss, grad_norm: None  # every update applies
    return trainer


def measure(rows, args) -> list:
    """Per layer host µs (median over steps) and ATen calls of each phase, for each
    ``(mixer, impl, compiled)`` in ``rows``: every model is built first, then stepped in
    turn (warm-up, timed steps, counted steps), so that drift in the machine's load hits
    them alike."""
    trainers = [build(*row, args) for row in rows]
    times = [{clock: {p: [] for p in (*PHASES, "step")} for clock in CLOCKS} for _ in rows]
    counts, warmup_s = [], [0.0] * len(rows)
    with no_kernel_launches() as fills, Phases(fills).installed() as phases:
        for step in range(args.warmup + args.steps):
            for i, trainer in enumerate(trainers):
                phases.clear()
                w0, c0 = time.perf_counter() - fills.wall, time.thread_time() - fills.cpu
                trainer.train_one_step()
                wall = time.perf_counter() - fills.wall - w0
                cpu = time.thread_time() - fills.cpu - c0
                if step < args.warmup:
                    warmup_s[i] += wall
                    continue
                for clock, step_s, phase_s in (("wall", wall, phases.wall),
                                               ("cpu", cpu, phases.cpu)):
                    times[i][clock]["step"].append(step_s)
                    for p in PHASES:
                        times[i][clock][p].append(phase_s[p])
        for trainer in trainers:
            counter = AtenCounter()
            phases.counter = counter
            with counter:
                for _ in range(args.count_steps):
                    trainer.train_one_step()
            phases.counter = None
            counts.append(counter)
    out = []
    for (mixer, impl, compiled), trainer, t, counter, w in zip(rows, trainers, times, counts,
                                                               warmup_s):
        layers = trainer.run.model.num_layers
        calls = {p: counter.counts[p] / (args.count_steps * layers) for p in PHASES}
        calls["step"] = sum(counter.counts.values()) / (args.count_steps * layers)
        us = {clock: {p: statistics.median(v) * 1e6 / layers for p, v in t[clock].items()}
              for clock in CLOCKS}
        out.append(dict(
            mixer=mixer, impl=impl, mode="compiled" if compiled else "eager", layers=layers,
            host_us=us[args.clock], host_us_wall=us["wall"], host_us_cpu=us["cpu"],
            aten_calls=calls, warmup_s=w, loss=trainer.last.loss))
    return out


def rows_wanted(args):
    from depthmix.mixers import available, get_mixer

    names = available() if args.mixers == "all" else args.mixers.split(",")
    names = ["vanilla", *[n for n in names if n != "vanilla"]]
    impls = args.impl.split(",")
    modes = {"eager": [False], "compiled": [True], "both": [False, True]}[args.compile]
    for name in names:
        for impl in (["torch"] if name == "vanilla" else impls):
            if impl == "triton" and not get_mixer(name).kernels and "torch" in impls:
                continue  # no kernel: impl=triton runs the PyTorch code
            for compiled in modes:
                yield name, impl, compiled


def table(rows) -> str:
    """Markdown: host µs and ATen calls per layer per step, forward / backward / optimizer,
    and forward + backward against vanilla's in the same mode."""
    vanilla = {r["mode"]: r for r in rows if r["mixer"] == "vanilla"}
    out = []
    for r in rows:
        h, c = r["host_us"], r["aten_calls"]
        base = vanilla.get(r["mode"])
        fb, cfb = h["forward"] + h["backward"], c["forward"] + c["backward"]
        ratio = aten_ratio = "-"
        if base:
            ratio = f"{fb / (base['host_us']['forward'] + base['host_us']['backward']):.2f}"
            base_calls = base["aten_calls"]["forward"] + base["aten_calls"]["backward"]
            aten_ratio = f"{cfb / base_calls:.2f}"
        out.append([r["mixer"], r["impl"], r["mode"], f"{h['forward']:.0f}",
                    f"{h['backward']:.0f}", f"{h['optimizer']:.0f}", f"{fb:.0f}", ratio,
                    f"{c['forward']:.1f}", f"{c['backward']:.1f}", f"{c['optimizer']:.1f}",
                    f"{cfb:.1f}", aten_ratio])
    head = ["mixer", "impl", "mode", "host µs fwd", "bwd", "opt", "fwd+bwd", "× vanilla",
            "ATen fwd", "bwd", "opt", "fwd+bwd", "× vanilla"]
    return tabulate(out, head, tablefmt="pipe", colalign=("left",) * 3 + ("right",) * 10,
                    disable_numparse=True)


def compile_gain(rows) -> str:
    """Vanilla's compiled forward + backward host time per layer over its eager one."""
    v = {r["mode"]: r["host_us"] for r in rows if r["mixer"] == "vanilla"}
    if len(v) < 2:
        return ""
    eager, compiled = (v[m]["forward"] + v[m]["backward"] for m in ("eager", "compiled"))
    return (f"vanilla, forward + backward host µs per layer: compiled {compiled:.0f} / eager "
            f"{eager:.0f} = {compiled / eager:.2f}")


# ---- custom op vs autograd.Function -------------------------------------------------------
def op_cases():
    """(name, fn(kernel entry) -> loss) per kernel op at one token: the host cost only."""
    from depthmix.kernels.attnres.function import attnres_triton
    from depthmix.kernels.ddl.function import ddl_read_triton, ddl_write_triton
    from depthmix.kernels.depth_mix.function import depth_mix_triton
    from depthmix.kernels.mhc.function import mhc_post_res_triton, mhc_read_triton, sinkhorn_triton

    def p(*shape):
        return torch.randn(*shape, requires_grad=True)

    q, k, v = p(1, 1, 4, 16), p(1, 1, 2, 16), p(1, 1, 2, 16)
    srcs = [p(1, 1, 2, 16) for _ in range(2)]
    ys = [p(1, 1, 64) for _ in range(4)]
    w, g = p(64), p(64)
    x, phi, alpha, bias = p(1, 1, 4, 64), p(256, 24), p(3), p(24)
    y, h_post, h_res = p(1, 1, 64), p(1, 1, 4), p(1, 1, 4, 4)
    logits = p(1, 4, 4)
    state, read, dv_params = p(1, 1, 64, 4), p(4), [p(64), p(1), p(4, 64), p(4)]
    return [
        ("depth_mix", lambda: depth_mix_triton(q, k, v, srcs, srcs)[1].sum()),
        ("attnres", lambda: attnres_triton(ys, w, g).sum()),
        ("mhc read", lambda: mhc_read_triton(x, phi, alpha, bias)[0].sum()),
        ("mhc post_res", lambda: mhc_post_res_triton(x, y, h_post, h_res).sum()),
        ("sinkhorn", lambda: sinkhorn_triton(logits, 20).sum()),
        ("ddl read", lambda: ddl_read_triton(state, read).sum()),
        ("ddl write", lambda: ddl_write_triton(state, y, y, *dv_params, 4.0, 1e-5)[0].sum()),
    ]


def op_comparison(reps: int, clock=time.thread_time, rounds: int = 7) -> list:
    """Median µs of one forward + backward of each op through the custom op and through the
    autograd.Function (:func:`depthmix.kernels._common.custom_ops_in_eager` picks the
    first), in alternating rounds; launches no-ops (no zero-fill: values do not matter)."""
    from depthmix.kernels._common import custom_ops_in_eager

    entries = {"function": contextlib.nullcontext, "custom_op": custom_ops_in_eager}
    times = {}
    with no_kernel_launches(zero_fill=False):
        cases = op_cases()
        for _, call in cases:
            for entry in entries.values():
                with entry():
                    for _ in range(10):
                        call().backward()
        for _ in range(rounds):
            for name, call in cases:
                for entry, ctx in entries.items():
                    with ctx():
                        t0 = clock()
                        for _ in range(reps):
                            call().backward()
                        times.setdefault((name, entry), []).append(
                            (clock() - t0) / reps * 1e6)
    return [dict(op=name, custom_op_us=statistics.median(times[(name, "custom_op")]),
                 function_us=statistics.median(times[(name, "function")]))
            for name, _ in cases]


def op_table(rows) -> str:
    body = [[r["op"], f"{r['custom_op_us']:.0f}", f"{r['function_us']:.0f}",
             f"{r['function_us'] / r['custom_op_us']:.2f}"] for r in rows]
    return tabulate(body, ["op (fwd + bwd, 1 token)", "custom op µs", "autograd.Function µs",
                           "ratio"], tablefmt="pipe", colalign=("left", "right", "right", "right"),
                    disable_numparse=True)


def main(argv=None):
    args = parse_args(argv)
    from depthmix import runtime
    from depthmix.runtime import log as run_log

    run_log.quiet_libraries(verbose=False)
    runtime.install()
    torch.set_num_threads(1)
    rows, op_rows = [], []
    if not args.ops_only:
        rows = measure(list(rows_wanted(args)), args)
        print(f"\nhost cost per layer per training step ({args.layers} layers, hidden "
              f"{args.hidden}, seq {args.seq}, micro-batch {args.micro_batch}, fp32, "
              f"torch {torch.__version__}, median of {args.steps} steps)\n")
        print(table(rows))
        print("\n" + compile_gain(rows))
    if args.ops_only or not args.no_ops:
        op_rows = op_comparison(args.op_reps, CLOCK_FUNCTIONS[args.clock])
        print("\n" + op_table(op_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, ops=op_rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
