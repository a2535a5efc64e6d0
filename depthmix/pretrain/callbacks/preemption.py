"""SIGTERM / SIGUSR1 / SIGINT (and submitit's signal) -> finish the step, save, exit cleanly.

The signal handler only sets a flag. After every step, and after every evaluation batch,
all ranks all-reduce it (MAX), so they stop at the same step / eval batch even when the
signal reached them at different times (or only some of them); the save starts within one
step or one eval batch of the signal. A second SIGINT (Ctrl-C) aborts at once without
saving (:data:`~depthmix.runtime.exit_codes.INTERRUPTED`). The trainer then ends the loop,
:class:`CheckpointCallback` saves in its ``post_train`` (put this callback after it) and
``depthmix-train`` returns normally:
**exit status 0 with a complete checkpoint of the last finished step**. The SLURM script
requeues the job when it was the one that forwarded the signal (see
``launch/slurm/train.sbatch``); a requeued or re-run job with the same output directory
resumes from that checkpoint.

Only the logging rank prints "received SIGTERM" (the signal usually reaches every rank):
one line per job. Under ``python -m depthmix.runtime.torchrun`` (the ``launch/`` scripts)
local rank 0 reports the run directory to the launcher, which writes torchrun's own log
there (:func:`report_run_dir`), and every rank that exits 0 leaves a mark
(:func:`mark_clean_exit`).

Under submitit (Hydra's SLURM launcher) the job's signal (``SIGUSR2`` by default) is
taken over the same way, and submitit's own handler (checkpoint the submission, requeue,
exit) runs in :meth:`PreemptionCallback.close`, after our checkpoint is saved and the
loggers are closed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

from depthmix.pretrain.callbacks.base import Callback
from depthmix.runtime import exit_codes
from depthmix.runtime.log import say
from depthmix.runtime.torchrun import EXIT_DIR_ENV, MARK_PREFIX, RUN_DIR_FILE

log = logging.getLogger("depthmix")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _submitit_signal():
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    name = "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return getattr(signal, name, None)


class PreemptionCallback(Callback):
    def __init__(self):
        self.received = None  # signal number, set by the handler
        self._previous = {}
        self._deferred = None  # (handler, signum) to call after saving (submitit)
        self._submitit_signal = None
        self._speaks = True  # the logging rank: it says that a signal came
        self._stopped = False  # every rank agreed to stop on a signal

    def _handler(self, signum, frame) -> None:
        # print, not log: logging from a signal handler can deadlock on its lock
        if signum == signal.SIGINT and self.received is not None:
            if self._speaks:
                os.write(2, f"[depthmix] second SIGINT: aborting without saving (exit "
                            f"{exit_codes.INTERRUPTED})\n".encode())
            from depthmix.checkpoint import guard

            guard.release_all()  # (forked helpers die with us: runtime.patches.ForkedHelpers)
            os._exit(exit_codes.INTERRUPTED)
        if self.received is None:
            self.received = signum
            if not self._speaks:
                return
            again = " (Ctrl-C again aborts without saving)" if signum == signal.SIGINT else ""
            os.write(2, f"[depthmix] received {signal.Signals(signum).name}: will save a "
                        f"checkpoint after this step or eval batch and exit{again}\n".encode())

    def setup(self, trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: preemption signals are not handled")
            return
        self._speaks = trainer.topo.is_logging_rank
        if os.environ.get(EXIT_DIR_ENV):
            report_run_dir(trainer.run.output_dir)
        signals = list(SIGNALS)
        extra = _submitit_signal()
        if extra is not None and extra not in signals:
            signals.append(extra)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        self._submitit_signal = extra

    def _agreed(self, trainer) -> int:
        """The signal any rank received (0 = none); collective."""
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        flag = torch.tensor([int(self.received or 0)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def post_step(self, trainer, result) -> None:
        signum = self._agreed(trainer)
        if signum:
            self._stop(trainer, signum, "")

    def post_eval_batch(self, trainer, index: int) -> None:
        if trainer.stop_reason is not None:
            return
        signum = self._agreed(trainer)  # every rank runs the same eval batches
        if signum:
            self._stop(trainer, signum, f" (in evaluation, after eval batch {index + 1}/"
                                        f"{trainer.run.train.eval_iters})")

    def _stop(self, trainer, signum: int, where: str) -> None:
        name = signal.Signals(signum).name
        trainer.request_stop(f"preempted ({name})")
        self._stopped = True
        if signum == self._submitit_signal:
            previous = self._previous.get(signum)
            if callable(previous):
                self._deferred = (previous, signum)
        if trainer.topo.is_logging_rank:
            say(f"preemption ({name}) at step {trainer.step}{where}: saving a checkpoint "
                "and exiting with status 0")

    def post_train(self, trainer) -> None:
        self._restore()
        if self._stopped:
            # the save is done (CheckpointCallback.post_train) and every rank agreed to stop:
            # rank 0's "saved checkpoint" line comes out before the logging rank's closing
            # summary, which then ends the console
            dist.barrier()

    def close(self, trainer) -> None:
        """Last of all (the checkpoint is saved, loggers closed): hand over to submitit if
        its signal stopped us (it checkpoints the submission, requeues and exits)."""
        self._restore()
        if self._deferred is not None:
            handler, signum = self._deferred
            self._deferred = None
            dist.barrier()
            handler(signum, None)

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            try:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            except (TypeError, ValueError):
                pass
        self._previous = {}


def report_run_dir(output_dir: str) -> None:
    """Local rank 0 tells the launcher (:mod:`depthmix.runtime.torchrun`) where this run
    writes (``$DEPTHMIX_EXIT_DIR/run_dir``): torchrun's log goes there."""
    directory = os.environ.get(EXIT_DIR_ENV)
    if not directory or not os.path.isdir(directory) or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    path = os.path.join(directory, RUN_DIR_FILE)
    try:
        with open(path + ".tmp", "w") as f:
            f.write(os.path.abspath(output_dir) + "\n")
        os.replace(path + ".tmp", path)  # the launcher never reads half a path
    except OSError as e:
        log.warning("could not tell the launcher the run directory (%s): %s", directory, e)


def mark_clean_exit(reason: str) -> None:
    """Tell the launcher this rank is about to exit 0 (``$DEPTHMIX_EXIT_DIR/rank<N>``).

    torchrun exits 1 whenever it received a signal itself, even when every rank then saved
    and exited 0; :mod:`depthmix.runtime.torchrun` exits 0 instead when every local rank
    left this mark."""
    directory = os.environ.get(EXIT_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return
    rank = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
    try:
        with open(os.path.join(directory, f"{MARK_PREFIX}{rank}"), "w") as f:
            f.write(reason + "\n")
    except OSError as e:
        log.warning("could not write the exit mark in %s: %s", directory, e)
