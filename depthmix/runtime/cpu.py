"""Run Megatron-Core on machines without CUDA (CPU + gloo).

Megatron-Core assumes CUDA in a handful of places: it allocates on
``torch.cuda.current_device()``, saves and restores the CUDA RNG state, creates
streams and events, branches on ``Tensor.type()`` strings, and hands the all-to-all token
dispatcher's split sizes to c10d as the NumPy arrays it copies from the GPU. When CUDA is absent,
:class:`CpuShim` redirects exactly those calls to the CPU. On a GPU machine it does
nothing. This is the only module in depthmix that knows about the CPU case; entry points
apply it through :func:`depthmix.runtime.install`.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode


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


class CpuShim:
    """Redirects Megatron's CUDA calls to the CPU while applied; does nothing when CUDA is
    present. :meth:`undo` restores every attribute it replaced and leaves the device mode."""

    def __init__(self):
        self._saved = []  # (object, attribute, original)
        self._mode = None

    def _replace(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def apply(self) -> None:
        if torch.cuda.is_available():
            return
        from megatron.core.tensor_parallel import random as mcore_random

        cpu = torch.device("cpu")
        redirects = {
            "current_device": lambda: cpu,
            "synchronize": lambda *a, **k: None,
            "empty_cache": lambda *a, **k: None,
            "get_rng_state": lambda *a, **k: torch.get_rng_state(),
            "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
            # must seed for real: TP ranks draw different streams from their tracker seeds
            "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
            "manual_seed_all": lambda seed: None,  # torch.manual_seed already seeded the CPU
            "Stream": _DummyStream,
            "Event": _DummyEvent,
            "current_stream": lambda *a, **k: _DummyStream(),
            "default_stream": lambda *a, **k: _DummyStream(),
            "stream": lambda *a, **k: contextlib.nullcontext(),
            "memory_allocated": lambda *a, **k: 0,
            "max_memory_allocated": lambda *a, **k: 0,
            "reset_peak_memory_stats": lambda *a, **k: None,
            "device_count": lambda: 0,
        }
        for name, value in redirects.items():
            self._replace(torch.cuda, name, value)
        self._replace(mcore_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        self._replace(mcore_random, "_set_cuda_rng_state",
                      lambda state, *a, **k: torch.set_rng_state(state))
        # the all-to-all dispatcher's split sizes: Megatron copies them to the host as NumPy
        # arrays only when they are CUDA tensors, and c10d's all_to_all_single takes no tensor
        from megatron.core.transformer.moe import token_dispatcher

        self._replace(token_dispatcher, "maybe_move_tensor_to_cpu", _to_host)
        # and with expert TP over expert-parallel ranks, it gathers and reduce-scatters
        # uneven shards, which NCCL does and gloo refuses
        from megatron.core.tensor_parallel import mappings

        self._replace(mappings, "_gather_along_first_dim",
                      _uneven_gather(mappings._gather_along_first_dim))
        self._replace(mappings, "_reduce_scatter_along_first_dim",
                      _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim))
        # Megatron's RNG tracker forks the "CUDA" generator, which is the CPU one here
        logging.getLogger(mcore_random.__name__).addFilter(_cpu_rng_notice)
        self._mode = _CudaToCpuMode()
        self._mode.__enter__()

    def undo(self) -> None:
        if self._mode is None:
            return
        self._mode.__exit__(None, None, None)
        self._mode = None
        from megatron.core.tensor_parallel import random as mcore_random

        logging.getLogger(mcore_random.__name__).removeFilter(_cpu_rng_notice)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the CPU: a NumPy copy
    where it asks for one, as it makes of a CUDA tensor."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy().copy()
    return tensor


def _uneven_gather(original):
    """Megatron's ``_gather_along_first_dim``; shards of different lengths
    (``output_split_sizes``) are padded to the longest for gloo's all-gather."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        import torch.distributed as dist

        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    return gather


def _uneven_reduce_scatter(original):
    """Megatron's ``_reduce_scatter_along_first_dim``; shards of different lengths
    (``input_split_sizes``) through an all-reduce of the whole tensor, for gloo."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        import torch.distributed as dist

        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        sizes = [int(n) for n in input_split_sizes]
        return torch.split(total, sizes)[group.rank()].clone()

    return reduce_scatter


def _cpu_rng_notice(record: logging.LogRecord) -> bool:
    return "CPU RNG state changed" not in record.getMessage()
