"""What a training run prints: one console stream that ``train.log`` receives too.

* :func:`say` is how the trainer's callbacks print a console line (step lines, eval lines,
  checkpoint saves, the closing summary). Under ``depthmix-train`` it logs through the
  ``depthmix.console`` logger, which Hydra's job logging (``configs/hydra/job_logging/
  depthmix.yaml``) sends to the console as the bare line and to ``<output_dir>/train.log``
  with a time stamp. Outside Hydra (tests, notebooks) it prints.
* :class:`ConsoleHandler` writes above a tqdm progress bar when one is active.
* :class:`LibraryWarnings` holds back the warnings Megatron-Core, Apex, Transformer Engine
  and deprecations raise while the run imports and builds, and turns them into one line
  ("fused kernels: Transformer Engine and Apex not installed, using PyTorch paths").
* :func:`quiet_libraries`: Megatron's config dumps and bucket lists go below INFO, W&B
  prints only errors. ``train.verbose=true`` keeps all of it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import List, Optional

CONSOLE = "depthmix.console"
LIBRARY_LOGGERS = ("megatron", "wandb")
_LIBRARY_FILES = re.compile(r"[\\/](megatron|apex|transformer_engine|torch|wandb)[\\/]")
_FALLBACK = re.compile(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed")
_FIRST_STEPS = re.compile(r"`torch\.distributed\.\w+` is deprecated"
                          r"|.*CUDA_DEVICE_MAX_CONNECTIONS")
"""Notices the libraries raise at a multi-rank run's first steps, after start-up, at every
run alike: torch's deprecation of the collectives Megatron calls for sequence parallelism
and the experts' dispatch (``all_gather_into_tensor``, ``reduce_scatter_tensor``), and
Megatron's sequence-parallel advice on ``CUDA_DEVICE_MAX_CONNECTIONS``."""

_bar = None  # the active tqdm bar (ProgressBar sets it)


def set_progress_bar(bar) -> None:
    global _bar
    _bar = bar


class ConsoleFormatter(logging.Formatter):
    """The message alone; warnings and errors prefixed with their level."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {text}"
        return text


class ConsoleHandler(logging.StreamHandler):
    """A stream handler that writes above the progress bar instead of through it, always to
    the current ``sys.stdout`` (a handler configured once in a process must not keep
    writing to a stream that was replaced since, e.g. by a test's capture)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if _bar is None:
            return super().emit(record)
        try:
            _bar.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def _console_configured() -> bool:
    return any(isinstance(h, ConsoleHandler) for h in logging.getLogger().handlers)


def say(text: str) -> None:
    """One console line of the run (also into ``train.log`` under ``depthmix-train``)."""
    if _console_configured():
        logging.getLogger(CONSOLE).info(text)
    elif _bar is not None:
        _bar.write(text)
    else:
        print(text, flush=True)


def also_to_file(path: str) -> None:
    """Send this process's console lines to ``path`` too, stamped as Hydra's job logging
    stamps ``train.log``. For the logging rank when it is not rank 0 (the last pipeline
    stage), whose job logging is the console only; a process with a log file keeps its
    own."""
    root = logging.getLogger()
    if not _console_configured() or any(isinstance(h, logging.FileHandler)
                                        for h in root.handlers):
        return
    handler = logging.FileHandler(path)  # appends beside rank 0's lines
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - "
                                           "%(message)s"))
    root.addHandler(handler)


def short_path(path: str) -> str:
    """Relative to the working directory when below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def quiet_libraries(verbose: bool) -> None:
    """Library INFO output (Megatron's DDP/optimizer/dataset config dumps, "Params for
    bucket" lists) only with ``train.verbose=true``. (W&B: ``callbacks.wandb`` asks it for
    errors only; ``WANDB_SILENT`` would hide those too.)"""
    if verbose:
        return
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class LibraryWarnings:
    """Collect the libraries' warnings during start-up; :meth:`finish` summarises them.

    Warnings raised from Megatron-Core, Apex, Transformer Engine, torch or wandb code (and
    any ``DeprecationWarning``/``FutureWarning``) are held back; depthmix's own warnings
    pass through. The messages seen stay filtered afterwards, so a library re-imported in a
    checkpoint-writer process does not print them again.
    """

    def __init__(self):
        self.held: List[warnings.WarningMessage] = []
        self._previous = None

    def start(self) -> "LibraryWarnings":
        if self._previous is None:
            self._previous = warnings.showwarning
            warnings.showwarning = self._show
        return self

    def _is_library(self, category, filename: str) -> bool:
        return (_LIBRARY_FILES.search(filename or "") is not None
                or issubclass(category, (DeprecationWarning, FutureWarning)))

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if self._is_library(category, filename):
            self.held.append(warnings.WarningMessage(message, category, filename, lineno,
                                                     file, line))
        else:
            self._previous(message, category, filename, lineno, file, line)

    def stop(self, keep_quiet: bool = True) -> None:
        """Stop collecting. With ``keep_quiet`` the messages held stay filtered, and so do
        the libraries' "not installed, falling back" notices (Megatron imports some modules
        lazily, e.g. at the first checkpoint save): the start-up line said it once; and the
        notices of the first steps (:data:`_FIRST_STEPS`)."""
        if self._previous is not None:
            warnings.showwarning = self._previous
            self._previous = None
        if not keep_quiet:
            return
        for w in self.held:
            warnings.filterwarnings("ignore", message=re.escape(str(w.message)))
        warnings.filterwarnings("ignore", message=_FALLBACK.pattern)
        warnings.filterwarnings("ignore", message=_FIRST_STEPS.pattern)

    def summary(self) -> Optional[str]:
        """One line for everything held back, or None."""
        messages = list(dict.fromkeys(str(w.message) for w in self.held))
        fallbacks = [m for m in messages if _FALLBACK.search(m)]
        others = [m for m in messages if m not in fallbacks]
        parts = []
        if fallbacks:
            missing = ("Transformer Engine and Apex"
                       if any("Transformer Engine" in m for m in fallbacks) else "Apex")
            parts.append(f"fused kernels: {missing} not installed, using PyTorch paths")
        if others:
            n = len(others)
            parts.append(f"{n} more library notice{'s' if n > 1 else ''} held back "
                         f"(train.verbose=true shows {'them' if n > 1 else 'it'})")
        return "; ".join(parts) or None

    def finish(self, verbose: bool = False) -> Optional[str]:
        """Stop collecting; with ``verbose`` show every held warning as it was, else return
        the one-line summary. Reports each warning once (a later call returns None)."""
        self.stop(keep_quiet=not verbose)
        line = None if verbose else self.summary()
        held, self.held = self.held, []
        if verbose:
            for w in held:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file,
                                     w.line)
        return line


startup_warnings = LibraryWarnings()
"""The process's collector: :func:`depthmix.runtime.install` starts it before anything
imports Megatron; the console callback reports it once the model is built."""
