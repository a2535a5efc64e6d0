"""What every depthmix command shares (depthmix-train's contract): a ``main`` returns the
exit status (:mod:`depthmix.runtime.exit_codes`); a configuration error, a typo'd option
(with the closest valid name) or a missing input path ends it with one line on stderr and
status 2, checked before torch or Megatron is imported (:func:`require_path`,
:class:`ArgumentParser`, :func:`depthmix.cli.overrides.hydra_points`); the libraries' notices stay off the console
(:func:`quiet_libraries`); every ``--help`` lists the exit statuses."""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import os
import sys
import textwrap
from typing import Callable, Iterator, Optional, Sequence, Tuple, Type

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
            except BrokenPipeError:  # `depthmix-eval --help | head`: the reader has gone
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return exit_codes.OK
            return exit_codes.OK if status is None else status

        return run

    return decorate(main) if main is not None else decorate


def compose_run(*overrides: str):
    """:func:`depthmix.config.load.compose_run`, with what Hydra refuses (an unknown key or
    group choice, bad syntax) as a :class:`ConfigError` naming it and the closest valid
    name in one line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from depthmix.config.load import compose_run as compose

    try:
        return compose(*overrides)
    except (HydraException, OmegaConfBaseException) as e:
        from depthmix.cli.overrides import compose_points

        compose_points(overrides)  # raises naming the closest valid names where it can
        raise ConfigError(str(e).strip().splitlines()[0]) from None


def _fill(text: str) -> str:
    """A one-line paragraph wrapped to the terminal's usual width; preformatted text as is."""
    return text if "\n" in text.strip() else textwrap.fill(text, 88)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage error is one line naming the closest valid option of a typo
    (``--tempreature`` -> ``--temperature``), with status 2; option names are exact (no
    abbreviations: ``--prefil`` is a typo, not ``--prefill``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        hint = ""
        if message.startswith("unrecognized arguments:"):
            from depthmix.config.validate import nearest

            # compared without their dashes, which every option shares ('--checkpoint' is
            # otherwise "close" to '--help')
            names = {s.lstrip("-"): s for a in self._actions for s in a.option_strings}
            for arg in message.split(":", 1)[1].split():
                if arg.startswith("-") and not hint:
                    match = nearest(arg.split("=", 1)[0].lstrip("-"), names)
                    hint = f"; did you mean {names[match]!r}?" if match else ""
        self.exit(exit_codes.CONFIG_ERROR,
                  f"{self.prog}: error: {message}{hint} ({self.prog} --help lists the "
                  "options)\n")


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter,
                         argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default (unless the help states it already)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == [] or action.default is argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def closest_name(value: str, names: Sequence[str]) -> str:
    from depthmix.config.validate import closest

    return closest(value, names)


def argument_parser(prog: str, description: str, *epilog: str) -> argparse.ArgumentParser:
    """argparse for a command: ``--help`` shows each option's default and ends with
    ``epilog`` (examples) and the exit statuses; a usage error is :class:`ArgumentParser`'s."""
    return ArgumentParser(
        prog=prog, description=_fill(description),
        epilog="\n\n".join(_fill(p) for p in (*epilog, exit_codes.HELP)),
        formatter_class=DefaultsFormatter)


def require_path(path: Optional[str], option: str, kind: str = "file") -> str:
    """``path`` (``~`` expanded) when it exists, else a :class:`ConfigError` naming
    ``option``. ``kind``: ``file``, ``dir``, ``glob`` (matches a file) or
    ``prefix`` (a Megatron data prefix: ``<path>.bin`` and ``<path>.idx``)."""
    full = os.path.expanduser(str(path or ""))
    if kind == "prefix":
        missing = [f"{full}{ext}" for ext in (".bin", ".idx") if not os.path.isfile(full + ext)]
        if missing:
            raise ConfigError(f"{option}={path}: no such data prefix ({' and '.join(missing)} "
                              "missing)")
        return full
    found = {"file": os.path.isfile, "dir": os.path.isdir,
             "glob": lambda p: any(os.path.isfile(f) for f in glob.glob(p))}[kind](full)
    if not path or not found:
        if kind == "glob" and glob.has_magic(full):
            raise ConfigError(f"{option}={path} matches no files")
        raise ConfigError(f"{option}={path}: no such {'directory' if kind == 'dir' else 'file'}")
    return full


def require_writable_dir(path: str, option: str) -> str:
    """The directory ``path`` is (or will be created) in: a :class:`ConfigError` naming
    ``option`` when its nearest existing parent cannot be written."""
    parent = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(f"{option}={path}: {parent} is not a writable directory")
    return path


def require_checkpoint(path: Optional[str], option: str) -> str:
    """The complete checkpoint ``path`` names (:func:`depthmix.checkpoint.store.find_checkpoint`,
    no torch import), or a :class:`ConfigError` naming ``option``."""
    from depthmix.checkpoint.store import find_checkpoint

    if not path:
        raise ConfigError(f"{option} is required: a train.save_dir or one iter_* checkpoint "
                          "directory")
    return find_checkpoint(os.path.expanduser(str(path)), option)


@contextlib.contextmanager
def quiet_libraries(verbose: bool = False) -> Iterator[None]:
    """Where a command imports torch or Megatron: their INFO lines silenced, their
    start-up warnings held back and the process patches installed (:mod:`depthmix.runtime`),
    as in training. Enter it after the checks, so that an error comes first and fast."""
    from depthmix import runtime
    from depthmix.runtime.log import quiet_libraries as quiet_loggers

    quiet_loggers(verbose)
    with runtime.installed():
        yield


def hydra_quote(value: str) -> str:
    """``value`` as a quoted Hydra override value (paths may hold ``=``, ``,``, ``[``)."""
    return "'" + value.replace("'", "\\'") + "'"


_collecting_statuses = False


def collect_statuses(on: bool) -> None:
    """While on, a :class:`HydraTask`'s non-zero status is returned to Hydra instead of ending
    the process: a local multirun's summary callback (:class:`depthmix.cli.sweep.
    SweepSummaryCallback`) records it and the next point runs."""
    global _collecting_statuses
    _collecting_statuses = on


class HydraTask:
    """A Hydra command's task function (``hydra.main(...)(HydraTask(task))``).

    Hydra ignores what a task returns, so a non-zero status ends the process here, except
    in a local multirun, whose summary callback collects the statuses and exits with the
    worst after the last point (:func:`collect_statuses`). Hydra's
    SLURM launcher (submitit) pickles the task into each job, where it is unpickled before
    Hydra resolves the job's output directory: unpickling registers the ``dm.*`` resolvers
    that directory needs (:func:`depthmix.runtime.env.register_resolvers`)."""

    def __init__(self, task: Callable[..., int]):
        self.task = task
        functools.update_wrapper(self, task)  # Hydra names the job after the task's module

    def __call__(self, cfg) -> Optional[int]:
        status = self.task(cfg)
        if status and _collecting_statuses:  # the sweep's summary reports it; the next point runs
            return status
        if status:
            sys.exit(status)
        return status

    def __reduce__(self):
        return _unpickled_task, (self.task,)


def _unpickled_task(task: Callable[..., int]) -> HydraTask:
    register_resolvers()
    return HydraTask(task)
