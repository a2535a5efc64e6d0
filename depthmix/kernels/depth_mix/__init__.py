"""Depth-Attention's depth step: ``depth_mix`` (and the weights it uses, ``depth_weights``).

``reference.py`` is plain PyTorch with fp32 statistics (``depth_mix``, the source of truth);
``function.py`` is the fused Triton kernel with the same signature (``fused_depth_mix``,
imported lazily so that importing this package never needs Triton). :func:`get_depth_mix`
maps the resolved ``mixer.impl`` to the function that runs.
"""

from depthmix.kernels.depth_mix.reference import (
    MIX_RULES,
    MIXED_STATES,
    depth_mix,
    depth_weights,
)


def get_depth_mix(impl: str):
    """The ``depth_mix`` implementation for a resolved ``mixer.impl``: ``torch`` (the
    reference) or ``triton`` (:func:`fused_depth_mix`)."""
    if impl == "auto":  # a config that skipped start-up resolution
        from depthmix.kernels.dispatch import resolve_impl

        impl = resolve_impl(impl)[0]
    if impl == "torch":
        return depth_mix
    if impl == "triton":
        from depthmix.kernels.depth_mix.function import fused_depth_mix

        return fused_depth_mix
    raise ValueError(f"depth_mix has no implementation {impl!r}")


def __getattr__(name):
    if name == "fused_depth_mix":
        from depthmix.kernels.depth_mix.function import fused_depth_mix

        return fused_depth_mix
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MIX_RULES", "MIXED_STATES", "depth_mix", "depth_weights", "fused_depth_mix",
           "get_depth_mix"]
