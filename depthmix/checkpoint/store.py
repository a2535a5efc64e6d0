"""Checkpoints on disk, without torch or Megatron: where they are, which one a run resumes
from, their metadata and health marks, and the check that a checkpoint fits the run.

The dry run and the start-up preflight use this module before any process group or model
exists; :mod:`depthmix.checkpoint.distributed` writes and loads the checkpoints themselves
(its docstring describes the directory layout).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Optional

from depthmix.checkpoint.record import mismatches
from depthmix.config.schema import ConfigError

log = logging.getLogger("depthmix")

TRACKER = "latest_checkpointed_iteration.txt"
META = "depthmix.json"
TOKENIZER = "tokenizer.json"
FORMAT_VERSION = 1


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def latest_checkpoint(root: Optional[str]) -> Optional[str]:
    """The complete checkpoint ``root``'s tracker names, or None.

    ``root`` may also be one checkpoint directory (``.../iter_0000500``) itself. If the
    tracker is missing or unreadable, or names a directory that is gone (a crash while
    replacing a re-saved step), the newest complete checkpoint is used, with a warning:
    never a fresh start while complete checkpoints exist.
    """
    if not root or not os.path.isdir(root):
        return None
    if is_complete(root):
        return root
    tracker = os.path.join(root, TRACKER)
    text = None
    try:
        with open(tracker, "rb") as f:
            text = f.read().decode("utf-8", "replace").strip()
        path = step_dir(root, int(text))
    except (OSError, ValueError) as e:
        complete = list_checkpoints(root)
        missing = isinstance(e, FileNotFoundError)
        what = "is missing" if missing else (
            f"is corrupt (holds {text!r}, not a step number)" if text is not None
            else f"is unreadable ({e})")
        if not complete:
            if missing:
                return None
            raise RuntimeError(f"{tracker} {what}, and there is no complete checkpoint")
        log.warning("%s %s; using the newest complete checkpoint, %s", tracker, what,
                    complete[-1][1])
        return complete[-1][1]
    if not is_complete(path):
        complete = list_checkpoints(root)
        if not complete:
            raise RuntimeError(f"{tracker} names step {text} but {path} is missing or "
                               "incomplete, and there is no other complete checkpoint")
        log.warning("%s names step %s but %s is missing or incomplete; using %s", tracker,
                    text, path, complete[-1][1])
        path = complete[-1][1]
    return path


def list_checkpoints(root: str) -> list:
    """Complete ``iter_*`` directories of ``root`` as (step, path), oldest first."""
    out = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.startswith("iter_") and name[5:].isdigit() and is_complete(path):
                out.append((int(name[5:]), path))
    return sorted(out)


def _meta_or_none(path: str) -> Optional[dict]:
    try:
        return read_meta(path)
    except (OSError, ValueError) as e:
        log.warning("%s/%s is unreadable (%s): checkpoint ignored", path, META, e)
        return None


def is_healthy(path: str) -> bool:
    """Saved after a finite step (checkpoints without a health mark count as healthy)."""
    meta = _meta_or_none(path)
    return meta is not None and meta.get("health", {}).get("healthy", True)


def newest_healthy(root: str, confirmed: bool = False) -> Optional[str]:
    """The newest healthy checkpoint; ``confirmed``: also followed by a finite step (its
    weights gave a finite loss and gradient)."""
    for _, path in reversed(list_checkpoints(root)):
        if is_healthy(path) and (not confirmed
                                 or read_meta(path).get("health", {}).get("confirmed", True)):
            return path
    return None


def set_health(path: str, **fields) -> None:
    """Rank 0: update the health mark of a published checkpoint (atomic rewrite of its
    ``depthmix.json``): confirmed by the next step, or demoted when that step failed."""
    meta = read_meta(path)
    meta.setdefault("health", {}).update(fields)
    _write_atomic(os.path.join(path, META), json.dumps(meta, indent=2))


def resume_candidates(root: Optional[str], warn: bool = True) -> list:
    """The checkpoints a resume from ``root`` may use, in the order to try them: at or
    below the tracker's step (:func:`latest_checkpoint`), newest first, healthy ones before
    unhealthy ones. ``root`` may be one checkpoint directory: then only it."""
    latest = latest_checkpoint(root)
    if latest is None:
        return []
    if os.path.normpath(latest) == os.path.normpath(root):
        return [latest]
    limit = int(os.path.basename(latest)[5:])
    paths = [p for s, p in reversed(list_checkpoints(root))
             if s <= limit and _meta_or_none(p) is not None]
    healthy = [p for p in paths if is_healthy(p)]
    ordered = healthy + [p for p in paths if p not in healthy]
    if warn and ordered and ordered[0] != latest:
        log.warning("the newest checkpoint %s was saved after a non-finite step (%s); "
                    "resuming from the newest healthy one, %s", latest,
                    (_meta_or_none(latest) or {}).get("health"), ordered[0])
    elif warn and ordered and not healthy:
        log.warning("no healthy checkpoint in %s: resuming from %s, saved after a "
                    "non-finite step", root, ordered[0])
    return ordered


def default_save_dir(run) -> str:
    return run.train.save_dir or os.path.join(run.output_dir, "checkpoints")


def check_record(path: str, run, weights_only: bool, source: str = "train.load_dir") -> None:
    """Refuse (ConfigError naming each differing option) to resume ``path`` into a run it
    was not saved by; with ``weights_only`` the differences are only logged (precision may
    change). ``source``: the option that led to ``path``, for the hint."""
    rec = (_meta_or_none(path) or {}).get("record")
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
        hint = (f"to fine-tune from its weights (fresh optimizer, schedule and step) add "
                "train.load_weights_only=true")
    else:
        hint = (f"{source} holds another run's checkpoints: give this run its own "
                f"train.save_dir (or output directory); to fine-tune from them add "
                f"train.load_dir={path} train.load_weights_only=true")
    raise ConfigError(f"cannot resume checkpoint {path}: it differs from this run in "
                      f"{'; '.join(diffs)}. {hint}")


def resume_source(run, save_dir: str, warn: bool = True) -> Optional[tuple]:
    """Where a run starts from: ``(candidates, weights_only, option)`` or None (fresh).

    The save directory's checkpoints if there are any (this run's own progress: a requeued
    or re-run job continues, loading everything), else ``train.load_dir``'s (it must hold a
    checkpoint; ``train.load_weights_only=true`` takes only its weights). ``candidates`` as
    :func:`resume_candidates` orders them; ``option`` names where they came from."""
    t = run.train
    candidates = resume_candidates(save_dir, warn=warn)
    if candidates:
        return candidates, False, f"train.save_dir={save_dir}"
    if not t.load_dir:
        return None
    candidates = resume_candidates(t.load_dir, warn=warn)
    if not candidates:
        raise ConfigError(f"train.load_dir={t.load_dir} holds no checkpoint "
                          f"(no {TRACKER}, no complete iter_* directory and no {META})")
    return candidates, t.load_weights_only, "train.load_dir"


def preflight_checkpoint(run) -> Optional[str]:
    """What this run would resume from, checked before any process group or model exists:
    the checkpoint path (None: a fresh start). Raises :class:`ConfigError` when
    ``train.load_dir`` holds no checkpoint or when the checkpoint's model record differs
    from ``run`` (each option named; see :func:`check_record`). Files are not verified
    here (that needs all ranks); a damaged checkpoint is replaced at load time."""
    source = resume_source(run, default_save_dir(run), warn=False)
    if source is None:
        return None
    candidates, weights_only, option = source
    check_record(candidates[0], run, weights_only, option)
    return candidates[0]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _remove(path: str) -> None:
    """Rename out of the way (so it never looks like a checkpoint), then delete."""
    if not os.path.exists(path):
        return
    trash = os.path.join(os.path.dirname(path), f".trash_{os.path.basename(path)}_{time.time_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
