import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run in Triton's interpreter on CPU; it must be chosen before triton.jit runs.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_SILENT", "true")


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
