import os
import re

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
HAS_CUDA = __import__("torch").cuda.is_available()
# Triton kernels run in Triton's interpreter on CPU; it must be chosen before triton.jit runs.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# inductor compiles in the test's own process, not in a pool of worker processes: one core
# per xdist worker
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# inductor writes scalar C++ on CPU: what the compile tests check (graphs, breaks, parity with
# eager) does not depend on the CPU kernels' SIMD, and a cold compile is a quarter quicker
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

from process_launches import Launches  # noqa: E402

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
MULTIPROC_GROUP = "multiproc"
FULL = "full"
NO_CUDA = "needs a CUDA GPU (tools/gpu_bench.py runs the gpu tests on one)"


@pytest.hookimpl(optionalhook=True)  # pytest without pytest-xdist (tools/gpu_bench.py)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per core, and none (a plain in-process
    run, so ``--pdb``/``-s``/breakpoints work) for named tests (``path::test``) or a debugger."""
    if config.option.usepdb or config.option.trace or any("::" in a for a in config.args):
        return 0
    return CORES


def pytest_configure(config):
    # torch threads per xdist worker: workers x threads = cores
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, CORES // workers))


def full_lane_deselected(markexpr: str) -> bool:
    """Whether a run leaves out the tests marked ``full``: unless its ``-m`` expression
    names ``full`` (``-m full``: only those; ``-m "not multiproc"``: the default lane's
    in-process tests)."""
    return re.search(rf"\b{FULL}\b", markexpr or "") is None


def _named_tests(config) -> list:
    """Node ids (or their prefixes up to a parametrization) named on the command line: a
    test of the full lane named this way runs."""
    named = []
    for arg in config.args:
        path, sep, rest = str(arg).partition("::")
        if sep:
            rel = os.path.relpath(os.path.abspath(path), str(config.rootpath))
            named.append(f"{rel}::{rest}".replace(os.sep, "/"))
    return named


def _is_named(nodeid: str, named: list) -> bool:
    return any(nodeid == n or nodeid.startswith((f"{n}[", f"{n}::")) for n in named)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The default lane: tests marked ``full`` are deselected unless ``-m`` names the marker
    (``pytest -m full`` runs the full lane alone) or the test is named (``path::test``).
    Tests marked ``gpu`` skip without CUDA.

    Every test with several processes at once in one xdist group (named before xdist
    reads the groups), so at most one multi-rank test runs at a time while the other workers
    take the rest (``multiproc(at_once=1)``: one child beside the waiting test). xdist hands
    out the largest group first: the long serial lane starts at once. Other groups (a
    module's one-rank layouts, ``tests/layouts.py``; tests sharing a module fixture that
    trains) are named the same way."""
    if full_lane_deselected(config.option.markexpr):
        named = _named_tests(config)
        full = [item for item in items if item.get_closest_marker(FULL)
                and not _is_named(item.nodeid.split("@")[0], named)]
        if full:
            config.hook.pytest_deselected(items=full)
            left_out = set(map(id, full))
            items[:] = [item for item in items if id(item) not in left_out]
    for item in items:
        if item.get_closest_marker("gpu") and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
        if _allowed(item) > 1:
            item.add_marker(pytest.mark.xdist_group(MULTIPROC_GROUP))
    result = yield
    if getattr(config.option, "loadgroup", False):
        # xdist 3.8 names the group in ``item._nodeid``, which pytest 9 no longer reads
        from _pytest.nodeid import NodeId

        for item in items:
            group = item.get_closest_marker("xdist_group")
            name = group and (group.args[0] if group.args else group.kwargs.get("name", "default"))
            if name and not item.nodeid.endswith(f"@{name}"):
                item._id = NodeId.parse(f"{item.nodeid}@{name}")
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.launches = Launches()
    item.launches.install()


def pytest_report_header(config):
    if full_lane_deselected(config.option.markexpr):
        return "default lane: tests marked full are left out (run them with -m full)"
    return None


def _allowed(item) -> int:
    """How many processes of its own the test may have running at once: 0 unmarked,
    ``multiproc(at_once=N)``'s N, else any number."""
    mark = item.get_closest_marker("multiproc")
    return 0 if mark is None else mark.kwargs.get("at_once", 1 << 30)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that starts a process (its setup included: session fixtures that train or
    spawn ranks) fails unless it is marked ``multiproc``, and one marked ``at_once=1`` fails
    when it had more than one running at once: the fast loop ``-m "not multiproc"`` is
    in-process tests only, and the serial lane holds every multi-rank test."""
    try:
        result = yield
    finally:
        item.launches.uninstall()
    peak, allowed = item.launches.peak, _allowed(item)
    if peak > allowed:
        hint = "@pytest.mark.multiproc(at_once=1)" if peak == 1 else "@pytest.mark.multiproc"
        pytest.fail(f"started {peak} process{'es' * (peak > 1)} at once: mark it {hint}",
                    pytrace=False)
    return result


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    if hasattr(item, "launches"):
        item.launches.uninstall()


@pytest.fixture(scope="session", autouse=True)
def depthmix_runtime():
    """The process-global patches every entry point installs (the CPU shim, ...), for the
    whole session; Python's warning handling stays pytest's."""
    from depthmix import runtime

    with runtime.installed(hold_warnings=False):
        yield


@pytest.fixture(scope="session")
def megatron_single():
    """In-process world of one rank with Megatron's parallel state (TP=PP=1)."""
    from depthmix.testing import init_single_process

    init_single_process()
    yield


TINY_TRAINING = ["model=tiny", "logger=none", "train.steps=60", "train.log_interval=20",
                 "train.eval_interval=60", "train.eval_iters=2"]


@pytest.fixture(scope="session")
def tiny_training(tmp_path_factory):
    """``depthmix-train`` of the README's tiny model on the embedded corpus (60 steps, eval
    at 60), run once for the whole session, xdist workers included. Returns (the run
    directory, its console output). Read-only: a test that writes into it copies it first
    (``shutil.copytree``)."""
    from filelock import FileLock

    from cli_processes import run

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny_training"
    done = root / "console.txt"
    root.mkdir(exist_ok=True)
    with FileLock(str(root / "lock")):
        if not done.exists():
            out = run("depthmix-train", [*TINY_TRAINING, f"hydra.run.dir={root}/run",
                                         f"data.cache_dir={root}/cache"], timeout=600).stdout
            done.write_text(out)
    return root / "run", done.read_text()
