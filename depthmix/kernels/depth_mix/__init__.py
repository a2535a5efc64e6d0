"""Depth-Attention's depth step: ``depth_mix`` (and the weights it uses, ``depth_weights``).

``reference.py`` is plain PyTorch with fp32 statistics; a fused Triton kernel (same
signature) will sit next to it. :func:`get_depth_mix` maps the resolved ``mixer.impl`` to
the function that runs.
"""

import logging

from depthmix.kernels.depth_mix.reference import (
    MIX_RULES,
    MIXED_STATES,
    depth_mix,
    depth_weights,
)

log = logging.getLogger("depthmix")

IMPLEMENTATIONS = {"torch": depth_mix}
"""``mixer.impl`` -> implementation. The Triton kernel registers as ``"triton"``."""


def get_depth_mix(impl: str):
    """The ``depth_mix`` implementation for a resolved ``mixer.impl`` (``torch``/``triton``).

    Until the fused kernel exists, ``triton`` runs the PyTorch reference and says so once.
    """
    if impl == "auto":  # a config that skipped start-up resolution
        from depthmix.kernels.dispatch import resolve_impl

        impl = resolve_impl(impl)[0]
    if impl in IMPLEMENTATIONS:
        return IMPLEMENTATIONS[impl]
    if impl == "triton":
        log.warning("mixer.impl=triton: depth_mix has no Triton kernel yet; running the "
                    "PyTorch reference")
        IMPLEMENTATIONS["triton"] = depth_mix
        return depth_mix
    raise ValueError(f"depth_mix has no implementation {impl!r}")


__all__ = ["MIX_RULES", "MIXED_STATES", "depth_mix", "depth_weights", "get_depth_mix"]
