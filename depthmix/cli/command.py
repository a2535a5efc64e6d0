"""What every depthmix command shares: a ``main`` returns the exit status
(:mod:`depthmix.runtime.exit_codes`), a configuration error ends it with one line on stderr
and status 2, and every ``--help`` lists the exit statuses."""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap
from typing import Callable, Optional, Tuple, Type

from depthmix.config.schema import ConfigError
from depthmix.runtime import exit_codes
from depthmix.runtime.env import register_resolvers


def command(main: Optional[Callable[..., Optional[int]]] = None, *,
            input_errors: Tuple[Type[BaseException], ...] = (), prog: str = "depthmix"):
    """Decorate a command's ``main``: its return value is the exit status (None: 0); a
    :class:`ConfigError` raised anywhere in it is one line on stderr and status 2.
    ``input_errors``: exceptions that mean the command could not read its input (a missing
    file, a damaged line): one line ``<prog>: error: ...`` and status 1, not a traceback."""

    def decorate(fn: Callable[..., Optional[int]]) -> Callable[..., int]:
        @functools.wraps(fn)
        def run(*args, **kwargs) -> int:
            try:
                status = fn(*args, **kwargs)
            except ConfigError as e:
                print(f"configuration error: {e}", file=sys.stderr, flush=True)
                return exit_codes.CONFIG_ERROR
            except input_errors as e:
                print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
                return exit_codes.CRASH
            return exit_codes.OK if status is None else status

        return run

    return decorate(main) if main is not None else decorate


def compose_run(*overrides: str):
    """:func:`depthmix.config.load.compose_run`, with what Hydra refuses (an unknown key or
    group choice, bad syntax) as a :class:`ConfigError` naming it in one line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from depthmix.config.load import compose_run as compose

    try:
        return compose(*overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None


def _fill(text: str) -> str:
    """A one-line paragraph wrapped to the terminal's usual width; preformatted text as is."""
    return text if "\n" in text.strip() else textwrap.fill(text, 88)


def argument_parser(prog: str, description: str, *epilog: str) -> argparse.ArgumentParser:
    """argparse for a command: ``--help`` ends with ``epilog`` (examples) and the exit
    statuses. (argparse's own usage errors exit 2 as well.)"""
    return argparse.ArgumentParser(
        prog=prog, description=_fill(description),
        epilog="\n\n".join(_fill(p) for p in (*epilog, exit_codes.HELP)),
        formatter_class=argparse.RawDescriptionHelpFormatter)


class HydraTask:
    """A Hydra command's task function (``hydra.main(...)(HydraTask(task))``).

    Hydra ignores what a task returns, so a non-zero status ends the process here, except
    in a local multirun, whose summary callback collects the statuses and exits with the
    worst after the last point (:func:`depthmix.cli.sweep.collecting`). Hydra's
    SLURM launcher (submitit) pickles the task into each job, where it is unpickled before
    Hydra resolves the job's output directory: unpickling registers the ``dm.*`` resolvers
    that directory needs (:func:`depthmix.runtime.env.register_resolvers`)."""

    def __init__(self, task: Callable[..., int]):
        self.task = task
        functools.update_wrapper(self, task)  # Hydra names the job after the task's module

    def __call__(self, cfg) -> Optional[int]:
        from depthmix.cli.sweep import collecting

        status = self.task(cfg)
        if status and collecting():  # the sweep's summary reports it; the next point runs
            return status
        if status:
            sys.exit(status)
        return status

    def __reduce__(self):
        return _unpickled_task, (self.task,)


def _unpickled_task(task: Callable[..., int]) -> HydraTask:
    register_resolvers()
    return HydraTask(task)
