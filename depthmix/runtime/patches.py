"""Run Megatron-Core on machines without CUDA (CPU + gloo).

Megatron-Core assumes CUDA in a handful of places: it allocates on
``torch.cuda.current_device()``, saves and restores the CUDA RNG state, creates
streams and events, and branches on ``Tensor.type()`` strings. When CUDA is absent,
:func:`activate` redirects exactly those calls to the CPU. On a GPU machine it does
nothing. This is the only module in depthmix that knows about the CPU case.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False


class _DummyStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _DummyEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DummyEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device='cuda'`` (or a CUDA ordinal) to the CPU in every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = torch.device("cpu")
        if func in (torch.Tensor.to,) and args and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


def activate() -> bool:
    """Install the CPU redirects if CUDA is unavailable. Idempotent; returns whether active."""
    global _ACTIVE
    if _ACTIVE:
        return True
    if torch.cuda.is_available():
        return False

    cuda = torch.cuda
    cpu = torch.device("cpu")
    cuda.current_device = lambda: cpu
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # Must seed for real: TP ranks draw different streams from their tracker seeds.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed already seeded the CPU
    cuda.Stream = _DummyStream
    cuda.Event = _DummyEvent
    cuda.current_stream = lambda *a, **k: _DummyStream()
    cuda.default_stream = lambda *a, **k: _DummyStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.device_count = lambda: 0

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # Megatron's RNG tracker forks the "CUDA" generator, which is the CPU one here.
    import logging

    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )
    _CudaToCpuMode().__enter__()
    _ACTIVE = True
    return True
