"""Benchmark tooling over the kernels and the model: what ``tools/`` runs, never what
training imports.

* ``<op>.py``, one per kernel op of :mod:`depthmix.kernels` (:data:`HOOKS`): benchmark
  cases, and the roofline work and GPU launches of their full shapes;
* :mod:`.case`: the unit ``tools/bench_kernels.py`` times; :mod:`.roofline`: the floors
  judged against measured times; :mod:`.gpu_report`: the sm_80/sm_90 compile report;
  :mod:`.peers`: Megatron's and Hugging Face's models beside ours.

Every list of ops (``tools/bench_kernels.py``, the GPU-compile report, the roofline table,
the tests) comes from :func:`depthmix.kernels.ops`.
"""

import importlib

HOOKS = ("cases", "roofline_work", "gpu_launches")
"""What an op's benchmark module defines: ``cases(smoke)`` (:class:`case.Case` list),
``roofline_work()`` (:class:`roofline.Work` list), ``gpu_launches()``
(:class:`gpu_report.Launch` list)."""


def hooks(op: str):
    """The benchmark module of kernel op ``op``; an error names any of :data:`HOOKS` it
    lacks."""
    module = importlib.import_module(f"{__name__}.{op}")
    missing = [hook for hook in HOOKS if not callable(getattr(module, hook, None))]
    if missing:
        raise AttributeError(f"kernel op {op!r} ({module.__file__}) has no {', '.join(missing)}")
    return module
