import pytest

from depthmix.config.schema import ConfigError
from depthmix.kernels.dispatch import resolve_impl


def test_torch_is_always_available():
    assert resolve_impl("torch")[0] == "torch"


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
