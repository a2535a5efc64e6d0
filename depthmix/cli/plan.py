"""``depthmix-plan``: which parallel layout should a run use on a given cluster
(:mod:`depthmix.planning.planner`)?

    depthmix-plan model=3b mixer=moda cluster.gpus=64 cluster.gpu=h100 cluster.nodes=8

``cluster.<option>=value`` describe the cluster; every other argument is an override of the
training config, as ``depthmix-train`` takes it.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from typing import List, Optional, Sequence, TextIO, Tuple

from depthmix.cli.command import command, compose_run
from depthmix.config.schema import ConfigError
from depthmix.planning import planner
from depthmix.planning.planner import Cluster
from depthmix.runtime import exit_codes


def _options() -> List[str]:
    return [f.name for f in dataclasses.fields(Cluster) if f.name != "micro_batch_sizes"]


def split_argv(argv: Sequence[str]) -> Tuple[Cluster, List[str]]:
    """``cluster.*`` overrides -> :class:`Cluster`; the rest compose the run."""
    cluster, rest = Cluster(), []
    for arg in argv:
        if not arg.startswith("cluster."):
            rest.append(arg)
            continue
        key, _, value = arg[len("cluster."):].partition("=")
        if key not in _options():
            raise ConfigError(f"cluster.{key} is unknown; choose from {sorted(_options())}")
        caster = str if key == "gpu" else (int if key in ("gpus", "nodes") else float)
        setattr(cluster, key, caster(value) if value not in ("null", "") else None)
    return cluster, rest


def help_text() -> str:
    return "\n".join([
        __doc__.strip(), "",
        textwrap.fill(f"cluster options: {', '.join(_options())} (gpu: one of "
                      f"{', '.join(sorted(planner.GPU_KINDS))}); see Cluster in "
                      "depthmix/planning/planner.py for their defaults.", 88), "",
        textwrap.fill(exit_codes.HELP, 88), ""])


@command
def main(argv: Optional[Sequence[str]] = None, out: Optional[TextIO] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout
    if "--help" in argv or "-h" in argv:
        print(help_text(), file=out)
        return
    cluster, rest = split_argv(argv)
    run = compose_run(*rest)
    try:
        planner.report(run, cluster, rest, out=out)
    except planner.NoFit as e:  # no layout fits: the configuration asks too much
        raise ConfigError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
