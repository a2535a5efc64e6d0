import pytest

from depthmix import kernels
from depthmix.config.schema import ConfigError
from depthmix.kernels.dispatch import resolve_impl
from depthmix.mixers import available, get_mixer
from depthmix.testing import variant_cases


@pytest.mark.parametrize("triton_usable", [False, True])
def test_torch_stays_torch_where_auto_would_pick_triton(monkeypatch, triton_usable):
    """``mixer.impl=torch`` is kept whatever Triton and CUDA can do; ``auto`` is not."""
    from depthmix.kernels import dispatch

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(dispatch, "triton_status", lambda: (triton_usable, "probe"))
    assert resolve_impl("torch") == ("torch", "requested")
    assert resolve_impl("auto")[0] == ("triton" if triton_usable else "torch")


def test_auto_without_cuda_is_torch(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert resolve_impl("auto")[0] == "torch"


def test_triton_without_cuda_or_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="mixer.impl=triton.*TRITON_INTERPRET"):
        resolve_impl("triton")


def test_triton_in_the_interpreter(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_impl("triton")[0] == "triton"


def test_unknown_impl_is_refused():
    with pytest.raises(ConfigError, match="mixer.impl"):
        resolve_impl("cuda")


# ---------------------------------------------------------------------------------------
# One kernel pattern: IMPLS per op package, one selector, Triton imported lazily
# ---------------------------------------------------------------------------------------

KERNEL_OPS = kernels.ops()
KERNEL_MIXERS = {test_id: (mixer, dict(variant.options))
                 for test_id, mixer, variant in variant_cases("kernels")}
"""Every mixer that runs a kernel (``Mixer.kernels``), with options under which it does."""


def test_ops_are_the_kernel_folders_and_the_mixers_use_them():
    import pathlib

    root = pathlib.Path(kernels.__file__).parent
    assert KERNEL_OPS == sorted(p.parent.name for p in root.glob("*/__init__.py"))
    used = {op for name in available() for op in get_mixer(name).kernels}
    assert used == set(KERNEL_OPS)


@pytest.mark.parametrize("op", KERNEL_OPS)
def test_op_package_names_its_two_implementations(op):
    import importlib

    from depthmix.kernels.dispatch import select

    package = importlib.import_module(f"depthmix.kernels.{op}")
    assert set(package.IMPLS) == {"torch", "triton"}
    assert package.IMPLS["torch"].endswith(f":{op}_reference")
    assert package.IMPLS["triton"].endswith(f":{op}_triton")
    assert select(op, "torch") is getattr(package, f"{op}_reference")


@pytest.mark.parametrize("op", KERNEL_OPS)
@pytest.mark.parametrize("impl", ["auto", "cuda", None])
def test_selector_refuses_an_unresolved_impl(op, impl):
    from depthmix.kernels.dispatch import select

    with pytest.raises(ValueError, match=f"impl={impl!r} is not resolved"):
        select(op, impl)


@pytest.mark.parametrize("case", sorted(KERNEL_MIXERS))
def test_a_model_with_unresolved_auto_is_refused_at_construction(megatron_single, case):
    """A config that skipped start-up resolution never reaches a kernel call: building
    the model stops at the first kernel it would pick."""
    from depthmix.testing import build_model, tiny_run

    mixer, options = KERNEL_MIXERS[case]
    run = tiny_run(mixer, **options)
    run.mixer.impl = "auto"
    with pytest.raises(ValueError, match="impl='auto' is not resolved"):
        build_model(run)


def test_loaded_configs_hold_a_resolved_impl():
    """The two ways a run config comes to exist: composed from YAML at start-up, and
    rebuilt from a checkpoint's record (generation, evaluation, export). (Both resolve
    whatever the mixer; one with a kernel stands for all.)"""
    from depthmix.checkpoint.record import record, run_from_record
    from depthmix.config.load import compose_run
    from depthmix.kernels.dispatch import RESOLVED

    run = compose_run("mixer=moda", "mixer.impl=auto")
    assert run.mixer.impl in RESOLVED
    saved = record(run)
    saved["mixer"]["impl"] = "auto"
    assert run_from_record(saved).mixer.impl in RESOLVED


_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # ``import triton`` now fails as if it were not installed
import torch
from depthmix import runtime
from depthmix.testing import build_model, init_single_process, tiny_run
runtime.install(hold_warnings=False)
init_single_process()
for name, options in {mixers!r}:
    run = tiny_run(name, impl="auto", **options)
    assert run.mixer.impl == "torch", run.mixer.impl
    model = build_model(run)
    ids = torch.randint(0, run.model.vocab_size, (2, run.model.seq_length))
    model(ids, labels=ids).sum().backward()
    print("ran", name)
assert sys.modules["triton"] is None
"""


@pytest.mark.multiproc(at_once=1)
def test_impl_torch_runs_every_kernel_mixer_without_triton():
    import subprocess
    import sys

    script = _WITHOUT_TRITON.format(mixers=list(KERNEL_MIXERS.values()))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [w for m, _ in KERNEL_MIXERS.values() for w in ("ran", m)]
