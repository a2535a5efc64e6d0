"""One retention rule (issue 24, acceptance 4): the checkpoints a save prunes after
publishing and those the disk-room path removes before writing come from the same
function, so room is never made by deleting what ``train.keep_last`` keeps.

For every history (healthy, unconfirmed, unhealthy, unmarked and unreadable checkpoints, a
re-saved step, a save below newer unhealthy ones) and ``keep_last`` value, the same save
directory is saved into twice: once directly (a real ``distributed.save``: its pruning),
once after the room path, short of space, removed all it may. Both end with the same
checkpoints; the room path removed a subset of what the save prunes, missing at most the
newest complete checkpoint (the resume point until the new one is published)."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest

from depthmix.checkpoint import guard, retention, store
from depthmix.testing import tiny_run

CONFIRMED = {"healthy": True, "confirmed": True}
UNCONFIRMED = {"healthy": True, "confirmed": False}
UNHEALTHY = {"healthy": False, "confirmed": False}
UNMARKED = "unmarked"  # saved before health marks existed: no "health" in depthmix.json
UNREADABLE = "unreadable"  # depthmix.json present but not JSON

# name: (existing checkpoints {step: mark}, the new checkpoint (step, mark), what
# keep_last=1 leaves)
HISTORIES = {
    "confirmed": ({2: CONFIRMED, 4: CONFIRMED, 6: CONFIRMED, 8: CONFIRMED},
                  (10, UNCONFIRMED), [8, 10]),
    "newest unconfirmed": ({2: CONFIRMED, 4: CONFIRMED, 6: UNCONFIRMED}, (8, UNCONFIRMED),
                           [4, 8]),
    "diverging": ({2: CONFIRMED, 4: UNHEALTHY, 6: UNHEALTHY}, (8, UNHEALTHY), [2, 8]),
    "unmarked": ({1: UNMARKED, 2: UNMARKED, 3: UNMARKED}, (4, UNCONFIRMED), [3, 4]),
    "unreadable": ({2: CONFIRMED, 4: UNREADABLE, 6: UNCONFIRMED}, (8, UNCONFIRMED), [2, 8]),
    "below newer unhealthy": ({3: CONFIRMED, 6: UNHEALTHY, 9: UNHEALTHY}, (5, UNCONFIRMED),
                              [3, 5, 9]),
    "re-saved step": ({2: CONFIRMED, 4: CONFIRMED, 6: UNCONFIRMED}, (6, UNCONFIRMED), [4, 6]),
    "first save": ({}, (2, UNCONFIRMED), [2]),
}


def _make(root: str, history: dict) -> None:
    for step, mark in history.items():
        path = store.step_dir(root, step)
        os.makedirs(path)
        with open(os.path.join(path, "shard.distcp"), "wb") as f:
            f.write(b"\0" * 4096)
        with open(os.path.join(path, store.META), "w") as f:
            if mark == UNREADABLE:
                f.write("{not json")
            else:
                json.dump({"step": step, **({} if mark == UNMARKED else {"health": mark})}, f)
    if history:
        with open(os.path.join(root, store.TRACKER), "w") as f:
            f.write(str(max(history)))


def _steps(root: str) -> list:
    return [s for s, _ in store.list_checkpoints(root)]


def _save(root: str, step: int, health: dict, keep_last: int) -> None:
    """A real save (write, publish, prune) of a state with no model or optimizer."""
    from depthmix.checkpoint import distributed

    topo = SimpleNamespace(tp=1, pp=1, vp=1, dp=1, ep=1, expert_tp=1, tp_rank=0, pp_rank=0,
                           dp_rank=0)
    distributed.save(root, run=tiny_run(), model=[], optimizer=None, scheduler=None,
                     topo=topo, step=step, consumed_samples=0, keep_last=keep_last,
                     health=health)


@pytest.mark.parametrize("keep_last", [0, 1, 2, 3])
@pytest.mark.parametrize("name", list(HISTORIES))
def test_save_and_the_room_path_delete_the_same_set(megatron_single, tmp_path, monkeypatch,
                                                   name, keep_last):
    history, (step, health), kept_at_1 = HISTORIES[name]
    direct, short = str(tmp_path / "direct"), str(tmp_path / "short")
    for root in (direct, short):
        os.makedirs(root)
        _make(root, history)
    before = set(_steps(direct))

    _save(direct, step, health, keep_last)
    pruned = before - {step} - set(_steps(direct))

    with monkeypatch.context() as m:  # no free space: the room path removes all it may
        m.setattr(guard, "free_bytes", lambda directory: 0)
        assert guard.make_room(short, step, keep_last, estimate=1, health=health)
    made_room = before - set(_steps(short))
    _save(short, step, health, keep_last)

    assert _steps(short) == _steps(direct)
    assert made_room <= pruned
    assert pruned - made_room <= {max(before, default=None)}  # the newest complete
    if keep_last == 0:
        assert _steps(direct) == sorted(before | {step})
    if keep_last == 1:
        assert _steps(direct) == kept_at_1
    assert not [n for n in os.listdir(direct) if n.startswith((store.TMP_PREFIX,
                                                               store.TRASH_PREFIX))]


def test_the_rule():
    """``doomed`` on its own: beyond the newest ``keep_last``, the newest healthy and the
    newest confirmed checkpoint and the one being saved are kept."""
    history = [(1, CONFIRMED), (2, CONFIRMED), (3, UNCONFIRMED), (4, UNHEALTHY),
               (5, None), (6, {}), (7, UNHEALTHY), (8, UNHEALTHY)]
    assert retention.doomed(history, 2, current=8) == [1, 2, 3, 4, 5]
    assert retention.doomed(history[:5], 1, current=5) == [1, 4]  # 3 healthy, 2 confirmed
    assert retention.doomed(history[:5], 1, current=4) == [1]  # the saved one stays
    assert retention.doomed(history, 0, current=8) == []
    assert retention.doomed(history, 10, current=8) == []


def test_leftovers_are_cleaned(tmp_path):
    root = str(tmp_path)
    _make(root, {1: CONFIRMED})
    for name in (f"{store.TMP_PREFIX}0000002", f"{store.TRASH_PREFIX}iter_0000000_1"):
        os.makedirs(os.path.join(root, name, "sub"))
    shutil.copytree(store.step_dir(root, 1), os.path.join(root, "not_a_leftover"))
    retention.clean_leftovers(root)
    assert sorted(os.listdir(root)) == ["iter_0000001", store.TRACKER, "not_a_leftover"]
