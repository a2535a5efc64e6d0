"""Every registered mixer runs in every shared grid and in the golden losses: a grid that
drops a mixer (a filter, a hard-coded list, a grid cut to save time) fails here, naming the
grid and the mixers."""

import importlib
import os
import sys

import pytest

from depthmix.mixers import available, get_mixer

TESTS = os.path.dirname(os.path.abspath(__file__))


def _cases(params) -> set:
    """Mixer names of ``pytest.param(mixer, ...)`` cases."""
    return {p.values[0] for p in params}


# test file: the mixers its grid runs in the default lane
GRIDS = {
    "parallel/test_parity.py": lambda m: {mixer for mixer, _ in m.CASES.values()},
    "mixers/test_conformance.py": lambda m: _cases(m.cases("decode")) & _cases(
        m.cases("recompute")),
    "megatron_ext/test_transport.py": lambda m: _cases(m.CASES),
    "inference/test_generate.py": lambda m: _cases(m.CASES),
    "planning/test_accounting.py": lambda m: {mixer for mixer, _ in m.VARIANTS.values()},
    "pretrain/test_compile.py": lambda m: set(m.MIXERS),
    "planning/test_memory_model.py": lambda m: set(m.ROTATION),
    "kernels/test_dispatch.py": lambda m: {mixer for mixer, _ in m.KERNEL_MIXERS.values()},
    "kernels/test_stack.py": lambda m: {mixer for mixer, _ in m.CASES.values()},
    "golden/test_golden_losses.py": lambda m: {o.split("=", 1)[1] for case in m.CASES.values()
                                               for o in case if o.startswith("mixer=")},
}


def _module(path: str):
    """The test module at ``path`` (under tests/), imported as pytest imports it."""
    folder, name = os.path.split(os.path.join(TESTS, path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name[:-3])


@pytest.mark.parametrize("path", sorted(GRIDS))
def test_grid_runs_every_registered_mixer(path):
    expected = set(available())
    if path.startswith("kernels/"):
        expected = {name for name in expected if get_mixer(name).kernels}
    missing = expected - GRIDS[path](_module(path))
    assert not missing, f"{path} does not run {sorted(missing)}"
