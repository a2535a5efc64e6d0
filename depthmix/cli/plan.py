"""``depthmix-plan``: which parallel layout should a run use on a given cluster
(:mod:`depthmix.planning.planner`)?

    depthmix-plan model=3b mixer=moda train=paper cluster.gpus=64 cluster.gpu=h100 cluster.nodes=8

``cluster.<option>=value`` describe the cluster; every other argument is an override of the
training config, as ``depthmix-train`` takes it (the global batch, sequence length and
precision come from there: pass the train preset you will run, e.g. ``train=paper``).
Planning takes seconds and needs no GPU.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from typing import List, Optional, Sequence, TextIO, Tuple

from depthmix.cli.command import command
from depthmix.config.schema import ConfigError
from depthmix.config.validate import closest
from depthmix.planning.planner import Cluster
from depthmix.runtime import exit_codes


def _fields() -> List[dataclasses.Field]:
    return [f for f in dataclasses.fields(Cluster) if f.name != "micro_batch_sizes"]


def _options() -> List[str]:
    return [f.name for f in _fields()]


def _parse(key: str, value: str):
    if value in ("null", ""):
        if key in ("gpus", "gpu"):
            raise ConfigError(f"cluster.{key} needs a value")
        return None
    caster = str if key == "gpu" else (int if key in ("gpus", "nodes") else float)
    try:
        parsed = caster(value)
    except ValueError:
        kind = "an integer" if caster is int else "a number"
        raise ConfigError(f"cluster.{key}={value!r} is not {kind}") from None
    if caster is not str and parsed <= 0 and key != "reserve_gib":
        raise ConfigError(f"cluster.{key}={value} must be positive")
    return parsed


def split_argv(argv: Sequence[str]) -> Tuple[Cluster, List[str]]:
    """``cluster.*`` overrides -> :class:`Cluster`; the rest compose the run."""
    cluster, rest = Cluster(), []
    for arg in argv:
        if not arg.startswith("cluster."):
            rest.append(arg)
            continue
        key, sep, value = arg[len("cluster."):].partition("=")
        if key not in _options():
            names = [f"cluster.{o}" for o in _options()]
            raise ConfigError(f"cluster.{key} is not a cluster option "
                              f"({', '.join(names)}){closest(f'cluster.{key}', names)}")
        if not sep:
            raise ConfigError(f"cluster.{key} needs a value: cluster.{key}=...")
        setattr(cluster, key, _parse(key, value))
    cluster.kind()  # an unknown cluster.gpu is refused here, naming the closest
    return cluster, rest


def help_text() -> str:
    from depthmix.cli.overrides import class_options
    from depthmix.planning import planner

    lines = [__doc__.strip(), "", "Cluster options (cluster.<option>=value):"]
    for o in class_options(planner.__file__, "Cluster"):
        if o.name == "micro_batch_sizes":
            continue
        lines.append(f"  cluster.{o.name}: {o.type} = {o.default}")
        lines.append(textwrap.fill(o.doc, 88, initial_indent="      ",
                                   subsequent_indent="      "))
    lines += ["", textwrap.fill(
        "Training options: every depthmix-train override (depthmix-train --help lists them); "
        "parallel.overlap_grad_reduce and parallel.overlap_param_gather decide how much "
        "data-parallel communication the plan hides behind compute. The model behind the "
        "ranking and its calibration against published layouts: docs/scaling.md.", 88),
        "", textwrap.fill(exit_codes.HELP, 88), ""]
    return "\n".join(lines)


def compose(overrides: Sequence[str]):
    """The run config of ``overrides``, refusing what depthmix-train refuses, with the
    closest valid name (:func:`depthmix.cli.overrides.compose_points`)."""
    from depthmix.cli.overrides import compose_points
    from depthmix.config.load import resolve

    return resolve(compose_points(["output_dir=.", *overrides])[0].cfg)


@command
def main(argv: Optional[Sequence[str]] = None, out: Optional[TextIO] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout
    if "--help" in argv or "-h" in argv:
        print(help_text(), file=out)
        return
    cluster, rest = split_argv(argv)
    from depthmix.mixers import mixer_of
    from depthmix.planning import plan_report, planner

    run = compose(rest)
    try:
        plan_report.report(run, mixer_of(run), cluster, rest, out=out)
    except planner.NoFit as e:  # no layout fits: the configuration asks too much
        raise ConfigError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
