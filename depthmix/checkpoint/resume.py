"""Which checkpoint a run starts from, and which one it rolls back to: the whole rule.

The files are :mod:`.store`'s (paths, tracker, ``depthmix.json`` with its model record,
health mark and file manifest); loading them is :mod:`.distributed`'s. What is decided here,
in the order it is decided:

1. **Where from** (:func:`resume_source`). The save directory (``train.save_dir``, default
   ``<output_dir>/checkpoints``) when it holds a checkpoint: this run's own progress, so a
   requeued or re-run job continues, loading everything (weights, optimizer, schedule, data
   position, RNG). Else ``train.load_dir`` when it is set: it must be a directory that names
   a checkpoint (one ``iter_*`` directory, a save directory, or a run's or import's output
   directory, :func:`.store.checkpoint_dir`), else the start is refused naming the closest
   checkpoint directory below it; ``train.load_weights_only=true`` takes only its weights
   (fresh optimizer, schedule and step). Else a fresh start.
2. **Which checkpoints, in which order** (:func:`resume_candidates`). The tracker's step
   (:func:`.store.latest_checkpoint`: a missing, unreadable or dangling tracker falls back
   to the newest complete ``iter_*`` with a warning, never to a fresh start; an unreadable
   tracker with no complete checkpoint is an error). Candidates are the complete
   checkpoints at or below that step with readable metadata, newest first, healthy ones
   (:func:`.store.is_healthy`) before those saved after a non-finite step; a warning says
   when the newest is passed over. A path that is one checkpoint directory is the only
   candidate.
3. **Whose checkpoint** (:func:`check_record`). The model record must match the run in
   every option that decides the weights, mixer or precision; a difference refuses the
   start with one line per option and how to fine-tune instead. With
   ``train.load_weights_only=true`` differences are only logged (precision may change). A
   weights-only checkpoint (an import) needs ``train.load_weights_only=true``.
4. **Intact files** (:func:`first_intact`, collective). The first candidate whose files
   match the sizes/checksums recorded at save (``train.ckpt_integrity``); a damaged one is
   skipped for the next with a warning; all damaged is an error.

Steps 1-3 run twice: before any process group or model exists (:func:`preflight_checkpoint`,
on the first candidate, files not read: a wrong checkpoint costs no start-up), and at start
on every rank (:func:`resume_point`: steps 1-4, the record checked on the intact one).
Rollback (``train.on_nonfinite=rollback``, :func:`rollback_point`) takes the newest healthy
intact checkpoint of the save directory. A save directory whose latest checkpoint has
reached ``train.steps`` is a finished run (:func:`finished_at`): its command has nothing
left to do.

Nothing here imports torch at module level (the start-up checks run without it); the
collective steps import the manifest check when they run.
"""

from __future__ import annotations

import logging
import os
from typing import List, NamedTuple, Optional

from depthmix.checkpoint import store
from depthmix.checkpoint.record import listed, mismatches
from depthmix.config.schema import ConfigError

log = logging.getLogger("depthmix")


class Source(NamedTuple):
    """Where a run starts from."""

    candidates: List[str]
    """Checkpoint paths in the order to try them (:func:`resume_candidates`)."""
    weights_only: bool
    option: str
    """The option that led there (``train.save_dir=...`` or ``train.load_dir``)."""


def resume_source(run, save_dir: str, warn: bool = True) -> Optional[Source]:
    """Step 1: the save directory's checkpoints, else ``train.load_dir``'s, else None
    (fresh start)."""
    t = run.train
    candidates = resume_candidates(save_dir, warn=warn)
    if candidates:
        return Source(candidates, False, f"train.save_dir={save_dir}")
    if not t.load_dir:
        return None
    if not os.path.isdir(t.load_dir):
        raise ConfigError(f"train.load_dir={t.load_dir}: no such directory")
    candidates = resume_candidates(store.checkpoint_dir(t.load_dir), warn=warn)
    if not candidates:
        raise store.no_checkpoint_error(t.load_dir, "train.load_dir")
    return Source(candidates, t.load_weights_only, "train.load_dir")


def resume_candidates(root: Optional[str], warn: bool = True) -> List[str]:
    """Step 2: the checkpoints a resume from ``root`` may use, in the order to try them."""
    latest = store.latest_checkpoint(root)
    if latest is None:
        return []
    if os.path.normpath(latest) == os.path.normpath(root):
        return [latest]
    limit = int(os.path.basename(latest)[5:])
    paths = [p for s, p in reversed(store.list_checkpoints(root))
             if s <= limit and store.meta_or_none(p) is not None]
    healthy = [p for p in paths if store.is_healthy(p)]
    ordered = healthy + [p for p in paths if p not in healthy]
    if warn and ordered and ordered[0] != latest:
        log.warning("the newest checkpoint %s was saved after a non-finite step (%s); "
                    "resuming from the newest healthy one, %s", latest,
                    (store.meta_or_none(latest) or {}).get("health"), ordered[0])
    elif warn and ordered and not healthy:
        log.warning("no healthy checkpoint in %s: resuming from %s, saved after a "
                    "non-finite step", root, ordered[0])
    return ordered


def check_record(path: str, run, weights_only: bool, source: str = "train.load_dir") -> None:
    """Step 3: refuse (ConfigError naming each differing option) to resume ``path`` into a
    run it was not saved by; with ``weights_only`` the differences are only logged.
    ``source``: the option that led to ``path``, for the hint."""
    meta = store.meta_or_none(path) or {}
    if meta.get("contents") == "weights" and not weights_only:
        raise ConfigError(f"checkpoint {path} holds weights only (an imported model: no "
                          "optimizer state, step or data position): start from it with "
                          f"train.load_dir={path} train.load_weights_only=true")
    rec = meta.get("record")
    if rec is None:
        log.warning("checkpoint %s records no model configuration: not checked", path)
        return
    diffs = mismatches(rec, run, ignore=("train.precision",) if weights_only else ())
    if not diffs:
        return
    if weights_only:
        log.warning("loading the weights of %s into a different configuration: %s", path,
                    "; ".join(diffs))
        return
    if source == "train.load_dir":
        hint = ("to fine-tune from its weights (fresh optimizer, schedule and step) add "
                "train.load_weights_only=true")
    else:
        hint = (f"{source} holds another run's checkpoints: give this run its own "
                f"train.save_dir (or output directory); to fine-tune from them add "
                f"train.load_dir={path} train.load_weights_only=true")
    raise ConfigError(f"cannot resume checkpoint {path}: it differs from this run in"
                      f"{listed(diffs)}\n{hint}")


def first_intact(candidates: List[str], mode: str) -> Optional[str]:
    """Step 4, collective: the first of ``candidates`` whose files match the sizes/checksums
    recorded at save (``mode``: ``train.ckpt_integrity``); damaged ones are skipped with a
    warning."""
    from depthmix.checkpoint import integrity  # torch.distributed

    for i, path in enumerate(candidates):
        problems = integrity.verify(path, store.read_meta(path).get("files"), mode)
        if not problems:
            return path
        log.warning("checkpoint %s is damaged (%s)%s", path, "; ".join(problems[:4]),
                    f"; trying {candidates[i + 1]}" if i + 1 < len(candidates) else "")
    return None


# ---------------------------------------------------------------------------------------
# The decisions the trainer and the start-up checks ask for
# ---------------------------------------------------------------------------------------


def preflight_checkpoint(run) -> Optional[str]:
    """Before any process group or model: what this run would resume from (None: a fresh
    start), steps 1-3 on the first candidate. Files are not verified here (that needs all
    ranks); a damaged checkpoint is replaced at load time."""
    source = resume_source(run, store.default_save_dir(run), warn=False)
    if source is None:
        return None
    check_record(source.candidates[0], run, source.weights_only, source.option)
    return source.candidates[0]


def resume_point(run, save_dir: str) -> Optional[tuple]:
    """Collective, at start: the checkpoint a run starts from, as ``(path, weights_only)``,
    or None (fresh): steps 1-4."""
    source = resume_source(run, save_dir)
    if source is None:
        return None
    path = first_intact(source.candidates, run.train.ckpt_integrity)
    if path is None:
        raise RuntimeError(f"every checkpoint to resume from is damaged: "
                           f"{', '.join(source.candidates)} (see the warnings above)")
    check_record(path, run, source.weights_only, source.option)
    return path, source.weights_only


def rollback_point(root: Optional[str], mode: str) -> Optional[str]:
    """Collective: the newest healthy checkpoint of ``root`` with intact files (``mode``:
    ``train.ckpt_integrity``), or None."""
    candidates = [p for p in resume_candidates(root, warn=False)
                  if store.is_healthy(p)] if root else []
    return first_intact(candidates, mode) if candidates else None


def finished_at(run) -> Optional[int]:
    """The step of the save directory's latest checkpoint when it has reached
    ``train.steps`` (the run is finished: re-running its command has nothing to do), else
    None. A damaged tracker counts as unfinished (the start-up checks report it)."""
    try:
        path = store.latest_checkpoint(store.default_save_dir(run))
    except RuntimeError:
        return None
    if path is None:
        return None
    step = (store.meta_or_none(path) or {}).get("step")
    return step if isinstance(step, int) and step >= run.train.steps else None
