"""GPU readiness without a GPU: every Triton kernel of the kernel ops compiled to sm_80 and
sm_90 machine code, with what ptxas says about each.

Which kernels, with which compile-time choices: each op's host launchers
(``kernels/<op>/triton.py``) run, forward then backward, on ``meta`` tensors (shapes and
dtypes, no data) at the full benchmark shapes of its ``bench.py`` (``gpu_launches``).
While they run, every kernel of the module is swapped for a recorder
(:func:`recorded_launches`), so what is kept is exactly what the launcher passes on a GPU:
sizes, strides, pointer dtypes, constexprs (tiles, flags) and ``num_warps`` /
``num_stages``. An autotuned kernel is expanded into its
module's ``CUDA_CONFIGS``, pruned by the autotuner's own ``early_config_prune``. Launches
that differ only in runtime arguments (another ``T``) compile once; the first benchmark
shape that made them names them.

Each launch is compiled by ``triton.compile`` for ``GPUTarget("cuda", 80 | 90, 32)`` (no
driver involved); Triton calls ``ptxas -v``, and its log gives registers per thread, spill
stores / loads and the stack frame. ``metadata.shared`` is the shared memory the kernel
asks for at launch. The compiles go to a Triton cache of the report's own
(:func:`report_cache_dir`), with ptxas's figures stored beside each kernel: a later report
reads them instead of compiling again, as long as Triton's cache key is the same (the
kernel's source and the functions it calls, signature, constexprs, options, target, Triton
and ptxas versions, Triton's environment). ``fresh=True`` (``--fresh`` in the tool,
``DEPTHMIX_KERNEL_REPORT_FRESH=1``) compiles everything again, reading and leaving nothing.

Where this differs from a real launch: integers derived from the SM count (the persistent
grids of attnres and mhc) see one SM (runtime arguments: only their divisibility
specialization can differ), and every pointer counts as 16-byte aligned (meta tensors sit
at address 0; fresh CUDA allocations are aligned too).

Must run in a process without ``TRITON_INTERPRET=1`` (under it ``triton.jit`` builds
interpreted functions that cannot be compiled): ``tools/kernel_report.py``, or
:func:`compile_report` in a subprocess as ``tests/bench/test_gpu_report.py`` does.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch


# ---------------------------------------------------------------------------------------
# Architectures and their limits
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    name: str
    capability: int
    max_shared: int
    """Bytes of shared memory one block may request (dynamic, opted in)."""
    max_registers: int = 255
    """Per thread."""


# NVIDIA CUDA C++ Programming Guide, "Technical Specifications per Compute Capability":
# 163 KB of shared memory per block on 8.0 (A100), 227 KB on 9.0 (H100/H200).
ARCHS: Dict[int, Arch] = {
    80: Arch("sm_80", 80, 163 * 1024),
    90: Arch("sm_90", 90, 227 * 1024),
}


# ---------------------------------------------------------------------------------------
# Recording the launches
# ---------------------------------------------------------------------------------------


@dataclass
class Launch:
    """One kernel as a launcher launches it: the ``JITFunction`` and its arguments."""

    op: str
    variant: str
    """The benchmark shape's compile-relevant part, e.g. ``G4 hd128 D48``."""
    kernel: object
    args: tuple
    kwargs: dict
    """Constexprs, ``num_warps``, ``num_stages``."""

    @property
    def name(self) -> str:
        return self.kernel.__name__

    @property
    def config(self) -> str:
        """Tile constexprs (``BLOCK_*``, two-letter ``B*`` and ``SUB``), warps, stages."""
        tiles = [f"{k}={v}" for k, v in self.kwargs.items() if _is_tile(k)]
        return " ".join(tiles + [f"w{self.num_warps}", f"s{self.num_stages}"])

    @property
    def num_warps(self) -> int:
        return self.kwargs.get("num_warps", 4)

    @property
    def num_stages(self) -> int:
        return self.kwargs.get("num_stages", 3)

    def key(self) -> tuple:
        """What the compiled code depends on, apart from runtime-argument specialization."""
        return (self.name, tuple(sorted((k, repr(v)) for k, v in self.kwargs.items())))


def _is_tile(name: str) -> bool:
    return re.fullmatch(r"BLOCK_\w+|B[A-Z]|SUB", name) is not None


class _Recorder:
    """Stands in for a kernel while a launcher runs: ``kernel[grid](*args, **kwargs)``
    appends ``(kernel, args, kwargs)`` to ``calls`` instead of launching."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


@contextlib.contextmanager
def recorded_launches(module) -> Iterator[list]:
    """Within the block, the module's Triton kernels record their launches into the
    yielded list; the kernels are put back on exit (before anything is compiled: Triton
    resolves a kernel's helpers through the module's globals)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    kernels = {name: obj for name, obj in vars(module).items()
               if isinstance(obj, (JITFunction, Autotuner))}
    calls: list = []
    try:
        for name, kernel in kernels.items():
            setattr(module, name, _Recorder(kernel, calls))
        yield calls
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)


def expand(op: str, variant: str, module, calls: list) -> List[Launch]:
    """Recorded calls as launches; an autotuned kernel becomes one launch per config of
    the module's ``CUDA_CONFIGS`` its prune keeps."""
    from triton.runtime.autotuner import Autotuner

    out = []
    for kernel, args, kwargs in calls:
        if not isinstance(kernel, Autotuner):
            out.append(Launch(op, variant, kernel, args, dict(kwargs)))
            continue
        configs = module.CUDA_CONFIGS
        if kernel.early_config_prune:
            named = dict(zip(kernel.arg_names, args))
            configs = kernel.early_config_prune(configs, named, **kwargs)
        out += [Launch(op, variant, kernel.fn, args, {**kwargs, **c.all_kwargs()})
                for c in configs]
    return out


def meta(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def launches(ops: Sequence[str] = ()) -> List[Launch]:
    """Every distinct launch of ``ops`` (default: every kernel op) at their benchmark
    shapes, from each op's ``gpu_launches`` (first shape wins)."""
    from depthmix import bench, kernels

    if os.environ.get("TRITON_INTERPRET") == "1":  # kernels are interpreted functions then
        raise RuntimeError("the kernel report needs a process without TRITON_INTERPRET=1")
    seen, out = set(), []
    for op in ops or kernels.ops():
        for launch in bench.hooks(op).gpu_launches():
            if launch.key() not in seen:
                seen.add(launch.key())
                out.append(launch)
    return out


# ---------------------------------------------------------------------------------------
# Compiling and reading ptxas
# ---------------------------------------------------------------------------------------


@dataclass
class Usage:
    """Resources of one compiled kernel on one architecture."""

    op: str
    kernel: str
    variant: str
    config: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    num_warps: int
    num_stages: int
    seconds: float = 0.0
    constexprs: Dict[str, str] = field(default_factory=dict)
    cached: bool = False
    """Read from the report cache (an earlier compile of the same key), not compiled now."""

    def problems(self) -> List[str]:
        """Why this kernel is not fit to run: spills, or a request above the limits."""
        arch = next(a for a in ARCHS.values() if a.name == self.arch)
        return check_limits(self.registers, self.spill_stores, self.spill_loads, self.shared,
                            arch)


def check_limits(registers: int, spill_stores: int, spill_loads: int, shared: int,
                 arch: Arch) -> List[str]:
    """What is wrong with a kernel of these resources on ``arch`` (empty: nothing)."""
    out = []
    if spill_stores or spill_loads:
        out.append(f"spills {spill_stores} B stored / {spill_loads} B loaded")
    if shared > arch.max_shared:
        out.append(f"shared memory {shared} B > {arch.max_shared} B ({arch.name})")
    if registers > arch.max_registers:
        out.append(f"{registers} registers > {arch.max_registers}")
    return out


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> Tuple[int, int, int, int]:
    """``(registers, spill store bytes, spill load bytes, stack frame bytes)`` of the one
    entry function in a ``ptxas -v`` log."""
    registers, frame = _PTXAS_REGISTERS.search(log), _PTXAS_FRAME.search(log)
    if registers is None or frame is None:
        raise ValueError(f"no resource usage in this ptxas log:\n{log}")
    stack, stores, loads = (int(x) for x in frame.groups())
    return int(registers.group(1)), stores, loads, stack


def _compile(launch: Launch, capability: int):
    """``(CompiledKernel, ptxas log)`` of ``launch`` for ``sm_<capability>``: what
    ``JITFunction.run`` does before it launches, with the target given instead of asked
    of a driver."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound, spec, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # where Triton prints the ptxas log
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=backend.target, options=options.__dict__)
    return compiled, log.getvalue()


FIGURES_FILE = "depthmix-ptxas-v1.json"  # beside a compiled kernel in the report cache


def compile_usage(launch: Launch, capability: int) -> Usage:
    """Compiles ``launch`` for ``sm_<capability>`` and reads its resources, inside
    :func:`fresh_compiles` or :func:`cached_compiles`: ptxas's figures of a kernel the cache
    already holds are the ones stored beside it."""
    from triton.runtime.cache import get_cache_manager

    start = time.perf_counter()
    compiled, log = _compile(launch, capability)
    cache = get_cache_manager(compiled.hash)
    stored = None if log else cache.get_file(FIGURES_FILE)
    if stored is not None:
        with open(stored) as f:
            figures = tuple(json.load(f))
    else:
        if not log:  # cached by a report that stopped before storing the figures
            with fresh_compiles():
                compiled, log = _compile(launch, capability)
        figures = parse_ptxas_log(log)
        cache.put(json.dumps(figures), FIGURES_FILE, binary=False)
    registers, stores, loads, stack = figures
    constexprs = {k: str(v) for k, v in launch.kwargs.items()
                  if k not in ("num_warps", "num_stages")}
    return Usage(launch.op, launch.name, launch.variant, launch.config,
                 ARCHS[capability].name, registers, stores, loads, stack,
                 compiled.metadata.shared, launch.num_warps, launch.num_stages,
                 time.perf_counter() - start, constexprs, cached=stored is not None)


def report_cache_dir() -> str:
    """Where the report's compiles and their ptxas figures stay between reports:
    ``kernel-report`` in depthmix's cache directory (``$DEPTHMIX_CACHE_DIR``, else
    ``~/.cache/depthmix``)."""
    from depthmix.data.datasets import default_cache_dir

    return os.path.join(default_cache_dir(), "kernel-report")


@contextlib.contextmanager
def _triton_cache(directory: str, always_compile: bool) -> Iterator[None]:
    from triton import knobs

    saved = (knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log, knobs.cache.dir)
    knobs.compilation.always_compile = always_compile
    knobs.nvidia.dump_ptxas_log = True  # a compile prints its ptxas log
    knobs.cache.dir = directory
    try:
        yield
    finally:
        (knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log,
         knobs.cache.dir) = saved


@contextlib.contextmanager
def fresh_compiles() -> Iterator[None]:
    """Every compile runs ptxas and prints its log; nothing is read from or left in any
    cache."""
    with tempfile.TemporaryDirectory(prefix="kernel-report-") as cache:
        with _triton_cache(cache, always_compile=True):
            yield


@contextlib.contextmanager
def cached_compiles(directory: Optional[str] = None) -> Iterator[None]:
    """Compiles into the report cache (default :func:`report_cache_dir`), reading what it
    holds: a kernel whose cache key is unchanged is not compiled again."""
    directory = directory or report_cache_dir()
    os.makedirs(directory, exist_ok=True)
    with _triton_cache(directory, always_compile=False):
        yield


_POOL_LAUNCHES: List[Launch] = []  # what forked workers index into


def _compile_task(task: Tuple[int, int]) -> Usage:
    index, capability = task
    return compile_usage(_POOL_LAUNCHES[index], capability)


def compile_report(ops: Sequence[str] = (), capabilities: Sequence[int] = (80, 90),
                   jobs: int = 1, only: Optional[Callable[[Launch, int], bool]] = None,
                   fresh: Optional[bool] = None) -> List[Usage]:
    """Compiles every launch of ``ops`` for every capability (``only(launch, capability)``
    picks a subset); ``jobs > 1`` compiles in that many forked processes. Kernels the
    report cache holds are read from it unless ``fresh`` (default:
    ``DEPTHMIX_KERNEL_REPORT_FRESH=1``)."""
    if fresh is None:
        fresh = os.environ.get("DEPTHMIX_KERNEL_REPORT_FRESH") == "1"
    _POOL_LAUNCHES[:] = launches(ops)
    tasks = [(i, cap) for i, launch in enumerate(_POOL_LAUNCHES) for cap in capabilities
             if only is None or only(launch, cap)]
    with fresh_compiles() if fresh else cached_compiles():
        if jobs <= 1:
            return [_compile_task(t) for t in tasks]
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_compile_task, tasks))


def first_variants(ops: Sequence[str] = ()) -> Callable[[Launch, int], bool]:
    """For :func:`compile_report`'s ``only``: every kernel in every config, each at its
    first benchmark variant (the launch lists put the heaviest first where it matters).
    Each other variant shares its tiles with a compiled one and differs in a group size,
    mixed state or head count (``tools/kernel_report.py --first-variants``)."""
    firsts: Dict[tuple, tuple] = {}
    for launch in launches(ops):
        firsts.setdefault((launch.name, launch.config), launch.key())
    chosen = set(firsts.values())
    return lambda launch, capability: launch.key() in chosen


def tool_versions() -> Dict[str, str]:
    """Triton and the ptxas it uses for each architecture."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    out = {"triton": triton.__version__}
    for capability, arch in ARCHS.items():
        tool = get_ptxas(capability)
        out[f"ptxas ({arch.name})"] = f"{os.path.basename(tool.path)} {tool.version}"
    return out
