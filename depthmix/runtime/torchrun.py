"""``python -m depthmix.runtime.torchrun``: torchrun (``torch.distributed.run``, the same
arguments) that keeps its own signal handling off the console. ``launch/local.sh`` and
``launch/slurm/node.sh`` start the ranks through it.

On SIGTERM, SIGINT or SIGHUP torchrun forwards the signal to its ranks and waits for them
(``PET_SHUTDOWN_TIMEOUT``). It then logs "Received 15 death signal, shutting down workers",
prints the traceback of its ``SignalException`` and exits 1, even when every rank saved a
checkpoint and exited 0. This wrapper changes three things:

* torchrun's log (the ``torch.distributed`` loggers: warnings, or what ``LOGLEVEL`` asks
  for) goes to ``<run dir>/torchrun.log`` (``torchrun.<host>.log`` for a multi-node
  job), not to the console. Local rank 0 reports the run directory in
  ``$DEPTHMIX_EXIT_DIR`` (:func:`depthmix.pretrain.callbacks.preemption.report_run_dir`);
  records from before that are held back and written with the first ones after. Records
  that never find a directory (the ranks stopped before training) go to stderr at the end.
* A signal stop ends quietly. The status is 0 when every local rank left its exit mark
  (:func:`depthmix.pretrain.callbacks.preemption.mark_clean_exit`: saved and exited 0).
  Otherwise the status is 1, and one line says how many ranks saved.
* A rank that fails ends torchrun with the first failed rank's status (2 for a
  configuration error, which the ranks printed themselves), not torchrun's 1 and its
  traceback: one line names the rank, its status and where torchrun's log is; a
  configuration error adds nothing to the ranks' own line.
* torchrun acts on the first death signal only. A repeated SIGTERM or SIGHUP (SLURM
  delivers its signal both directly and through ``srun``) is ignored while the ranks save.
  A second SIGINT goes to the ranks, which abort at once (a second Ctrl-C).

The ranks' own output is untouched: they write to the console themselves.
``DEPTHMIX_LAUNCH_VERBOSE=1`` prints torchrun's log on the console as well, and the
traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from typing import Iterator, List, Optional

from depthmix.runtime import exit_codes

EXIT_DIR_ENV = "DEPTHMIX_EXIT_DIR"
"""The per-launch directory of the ranks' exit marks and run directory (set by :func:`main`)."""
VERBOSE_ENV = "DEPTHMIX_LAUNCH_VERBOSE"
RUN_DIR_FILE = "run_dir"
MARK_PREFIX = "rank"


def clean_exits(exit_dir: str) -> int:
    """How many local ranks left an exit mark (saved and exited 0)."""
    return sum(1 for name in os.listdir(exit_dir) if name.startswith(MARK_PREFIX))


def reported_run_dir(exit_dir: str) -> Optional[str]:
    try:
        with open(os.path.join(exit_dir, RUN_DIR_FILE)) as f:
            return f.read().strip() or None
    except OSError:
        return None


class RunDirLog(logging.Handler):
    """Appends torchrun's records to ``<run dir>/<name>`` once the ranks reported the run
    directory, holding back the records that come before it."""

    def __init__(self, exit_dir: str, name: str):
        super().__init__()
        self.exit_dir, self.name = exit_dir, name
        self.path: Optional[str] = None
        self.held: List[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.held.append(self.format(record))
            self.flush()
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        if not self.held:
            return
        if self.path is None:
            run_dir = reported_run_dir(self.exit_dir)
            if run_dir is None:
                return
            self.path = os.path.join(run_dir, self.name)
        with open(self.path, "a") as f:
            f.write("\n".join(self.held) + "\n")
        self.held = []

    def close(self) -> None:
        """The records that never found a run directory go to stderr."""
        self.flush()
        if self.held:
            sys.stderr.write("\n".join(self.held) + "\n")
            self.held = []
        super().close()


@contextlib.contextmanager
def _torch_logs_to(handler: logging.Handler, verbose: bool) -> Iterator[None]:
    """Every ``torch.distributed`` record to ``handler`` (only there unless ``verbose``).
    torch gives ``torch.distributed`` and some of its children console handlers of their
    own that do not propagate: each of them gets ``handler`` instead of (or, ``verbose``,
    beside) its own."""
    top = logging.getLogger("torch.distributed")
    loggers = [top] + [logger for name, logger in logging.root.manager.loggerDict.items()
                       if name.startswith("torch.distributed.")
                       and isinstance(logger, logging.Logger) and not logger.propagate]
    saved = [(logger, list(logger.handlers), logger.propagate) for logger in loggers]
    for logger in loggers:
        if not verbose:
            logger.handlers = []
        logger.addHandler(handler)
    if not verbose:
        top.propagate = False
    try:
        yield
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate


def _log_name(nnodes: str) -> str:
    from torch.distributed.run import parse_min_max_nnodes

    multi_node = parse_min_max_nnodes(nnodes)[1] > 1
    return f"torchrun.{socket.gethostname()}.log" if multi_node else "torchrun.log"


def _once_per_launch() -> None:
    """torchrun's signal handler acts on the first death signal only (see module
    docstring). It installs ``api._terminate_process_handler`` by name when it starts the
    ranks, so replacing that name is enough."""
    import psutil
    from torch.distributed.elastic.multiprocessing import api

    first = api._terminate_process_handler
    stopping = []

    def terminate_once(signum, frame):
        if not stopping:
            stopping.append(signum)
            first(signum, frame)  # raises SignalException: torchrun forwards it and waits
        elif signum == signal.SIGINT:
            for rank in psutil.Process().children():
                try:
                    rank.send_signal(signal.SIGINT)
                except psutil.NoSuchProcess:
                    pass

    api._terminate_process_handler = terminate_once


def _failed(error, log: RunDirLog, verbose: bool) -> int:
    """The status of torchrun's ``ChildFailedError``: the first failed rank's."""
    rank, first = error.get_first_failure()
    if first.exitcode == exit_codes.CONFIG_ERROR:
        if not verbose:  # the ranks said what is wrong; torchrun's shutdown notes are noise
            log.held.clear()
        return exit_codes.CONFIG_ERROR
    how = (f"status {first.exitcode}" if first.exitcode > 0
           else f"signal {signal.Signals(-first.exitcode).name}")
    log.flush()
    where = log.path or "above"
    print(f"[depthmix] rank {rank} ended with {how}; torchrun's log: {where}",
          file=sys.stderr, flush=True)
    return first.exitcode if first.exitcode > 0 else exit_codes.CRASH


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = sys.argv[1:] if argv is None else argv
    args = torchrun.parse_args(argv)
    verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    exit_dir = os.environ[EXIT_DIR_ENV] = tempfile.mkdtemp(prefix="depthmix-exit.")
    log = RunDirLog(exit_dir, _log_name(args.nnodes))
    _once_per_launch()
    try:
        with _torch_logs_to(log, verbose):
            torchrun.main(argv)
        return exit_codes.OK
    except SignalException as e:
        if verbose:
            traceback.print_exc()
        ranks = torchrun.determine_local_world_size(args.nproc_per_node)
        saved = clean_exits(exit_dir)
        if saved >= ranks:
            return exit_codes.OK
        print(f"[depthmix] torchrun stopped by {signal.Signals(e.sigval).name}: {saved} of "
              f"{ranks} local ranks saved and exited 0 (exit {exit_codes.CRASH})",
              file=sys.stderr, flush=True)
        return exit_codes.CRASH
    except ChildFailedError as e:
        if verbose:
            traceback.print_exc()
        return _failed(e, log, verbose)
    finally:
        log.close()
        shutil.rmtree(exit_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
