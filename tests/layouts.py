"""Parameters for a grid of parallel layouts, one process group per world size: the layouts
that train in one rank (one child process: ``multiproc(at_once=1)``) stay together on one
xdist worker, as they share their module's process group; a layout of several ranks is
marked ``multiproc`` (conftest runs those one at a time). The default lane runs the grid's
default layouts, the full lane (``-m full``) the others."""

from __future__ import annotations

import pytest


def full_except(values, default, ids=None) -> list:
    """``pytest.param`` of each value, marked ``full`` unless it is in ``default``: a grid's
    wide part runs in the full lane."""
    return [pytest.param(v, id=None if ids is None else ids(v),
                         marks=() if v in default else pytest.mark.full) for v in values]


def layout_params(layouts: dict, module: str, default: str) -> list:
    """``layouts``: name -> (world size, ...); ``module``: the test module's ``__name__``;
    ``default``: the layout the default lane runs."""
    one_rank = [pytest.mark.multiproc(at_once=1), pytest.mark.xdist_group(f"{module}:one-rank")]
    return [pytest.param(name, id=name, marks=[
        *([pytest.mark.multiproc] if spec[0] > 1 else one_rank),
        *(() if name == default else (pytest.mark.full,))]) for name, spec in layouts.items()]


class PerWorld:
    """A module fixture's results, trained lazily one world size at a time:
    ``train(world)`` returns ``{key: result}`` for every key of that world size."""

    def __init__(self, train):
        self._train, self._done = train, {}

    def __call__(self, world: int) -> dict:
        if world not in self._done:
            self._done[world] = self._train(world)
        return self._done[world]
