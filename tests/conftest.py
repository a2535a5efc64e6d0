import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run in Triton's interpreter on CPU; it must be chosen before triton.jit runs.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# inductor compiles in the test's own process, not in a pool of worker processes: one core
# per xdist worker
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from process_launches import Launches  # noqa: E402

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
MULTIPROC_GROUP = "multiproc"


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


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every ``multiproc`` test in one xdist group (named before xdist reads the groups), so
    at most one multi-rank test runs at a time while the other workers take single-process
    tests. xdist hands out the largest group first: the long serial lane starts at once."""
    multiproc = [item for item in items if item.get_closest_marker("multiproc")]
    for item in multiproc:
        item.add_marker(pytest.mark.xdist_group(MULTIPROC_GROUP))
    result = yield
    if getattr(config.option, "loadgroup", False):
        # xdist 3.8 names the group in ``item._nodeid``, which pytest 9 no longer reads
        from _pytest.nodeid import NodeId

        for item in multiproc:
            if not item.nodeid.endswith("@" + MULTIPROC_GROUP):
                item._id = NodeId.parse(f"{item.nodeid}@{MULTIPROC_GROUP}")
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.launches = Launches()
    item.launches.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that had more than one process of its own running at once (its setup
    included: session fixtures that spawn ranks) fails unless it is marked ``multiproc``."""
    try:
        result = yield
    finally:
        item.launches.uninstall()
    if item.launches.peak > 1 and not item.get_closest_marker("multiproc"):
        pytest.fail(f"started {item.launches.peak} processes at once: mark it "
                    "@pytest.mark.multiproc", pytrace=False)
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
