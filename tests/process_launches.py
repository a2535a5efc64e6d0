"""Count the processes a test starts, to hold every test that runs more than one at a time
to the ``multiproc`` marker (that marker keeps them off the second xdist worker's core).

Watched: ``subprocess.Popen`` (a launcher counts as the ranks it starts: torchrun's
``--nproc-per-node``, ``NPROC_PER_NODE`` / ``DEPTHMIX_NPROC_PER_NODE`` in its environment)
and ``multiprocessing`` process starts (spawned ranks, pools). Not counted: processes
``fork``-ed from the test's own process, helpers that share its memory for a moment
(Megatron's checkpoint writers, two per save)."""

from __future__ import annotations

import multiprocessing.process
import os
import re
import subprocess

_NPROC_ARG = re.compile(r"--nproc[-_]per[-_]node[= ](\d+)")
_NPROC_ENV = ("DEPTHMIX_NPROC_PER_NODE", "NPROC_PER_NODE")


def _ranks(args, env) -> int:
    """How many processes a Popen of ``args`` amounts to (a launcher: its ranks)."""
    text = args if isinstance(args, (str, bytes)) else " ".join(map(str, args))
    counts = [int(n) for n in _NPROC_ARG.findall(str(text))]
    counts += [int(env[k]) for k in _NPROC_ENV if env and str(env.get(k, "")).isdigit()]
    return max([1, *counts])


class Launches:
    """While :meth:`watching`: the most processes this test had running at once."""

    def __init__(self):
        self.live = []  # (is_running, ranks)
        self.peak = 0
        self._originals = None

    def _started(self, is_running, ranks: int) -> None:
        self.live = [(alive, n) for alive, n in self.live if alive()] + [(is_running, ranks)]
        self.peak = max(self.peak, sum(n for _, n in self.live))

    def install(self) -> None:
        """Patch the two ways to start a process (undone by :meth:`uninstall`)."""
        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start
        launches = self

        def init(popen, args, *a, **kw):
            popen_init(popen, args, *a, **kw)
            env = kw.get("env") if kw.get("env") is not None else os.environ
            launches._started(lambda: popen.poll() is None, _ranks(args, env))

        def start(process):
            process_start(process)
            method = getattr(process, "_start_method", None) or \
                multiprocessing.get_start_method(allow_none=True) or "fork"
            if method != "fork":
                launches._started(process.is_alive, 1)

        subprocess.Popen.__init__ = init
        multiprocessing.process.BaseProcess.start = start
        self._originals = (popen_init, process_start)

    def uninstall(self) -> None:
        if self._originals:
            subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = \
                self._originals
            self._originals = None
