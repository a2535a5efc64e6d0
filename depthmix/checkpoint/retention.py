"""What a save directory keeps: the one keep/prune rule, and the one clean-up of leftovers.

``train.keep_last=N`` keeps the newest N checkpoints and, beyond them, the newest healthy
and the newest confirmed one (health marks: :mod:`depthmix.checkpoint.store`), so a run can
always go back to weights that gave a finite step; ``0`` keeps every checkpoint. The
checkpoint just saved is never removed, even when newer (unhealthy) ones exist.

Two paths apply the rule, through :func:`doomed`: save, after publishing (:func:`prune`),
and the disk-room check before writing (:func:`prunable_before`, :mod:`.guard`), which
applies it to the checkpoints on disk plus the one about to be saved, so it removes only
what that save removes anyway, and never the newest complete checkpoint (the run's resume
point until the new one is published).
"""

from __future__ import annotations

import os
import shutil
from typing import List, Optional, Sequence, Tuple

from depthmix.checkpoint import store

History = Sequence[Tuple[int, Optional[dict]]]
"""(step, health mark) of each complete checkpoint, oldest first; the mark as
:func:`store.health` reads it (``{}``: none, healthy and confirmed; None: unreadable)."""


def doomed(history: History, keep_last: int, current: int) -> List[int]:
    """THE rule: the steps of ``history`` that retention removes, oldest first, with
    ``keep_last`` and ``current`` the step being (or just) saved."""
    if keep_last <= 0:
        return []
    healthy = [(s, h) for s, h in history if h is not None and h.get("healthy", True)]
    confirmed = [s for s, h in healthy if h.get("confirmed", True)]
    keep = {current, *[s for s, _ in healthy][-1:], *confirmed[-1:]}
    return [s for s, _ in list(history)[:-keep_last] if s not in keep]


def prune(root: str, keep_last: int, current: int) -> None:
    """Rank 0, after publishing the checkpoint of ``current``: remove what :func:`doomed`
    says."""
    complete = dict(store.list_checkpoints(root))
    history = [(s, store.health(p)) for s, p in complete.items()]
    for step in doomed(history, keep_last, current):
        store.remove(complete[step])


def prunable_before(root: str, keep_last: int, step: int, health: dict) -> List[tuple]:
    """Before saving ``step`` with the health mark ``health``: the checkpoints (step, path),
    oldest first, that :func:`prune` removes once it is published, except the newest
    complete one."""
    complete = store.list_checkpoints(root)
    history = sorted([(s, store.health(p)) for s, p in complete if s != step]
                     + [(step, health)], key=lambda entry: entry[0])
    paths = dict(complete)
    newest = complete[-1][0] if complete else None
    return [(s, paths[s]) for s in doomed(history, keep_last, step) if s != newest]


def clean_leftovers(root: str) -> None:
    """Rank 0, before a save: remove what interrupted saves and prunes left behind."""
    for name in os.listdir(root):
        if name.startswith((store.TMP_PREFIX, store.TRASH_PREFIX)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
