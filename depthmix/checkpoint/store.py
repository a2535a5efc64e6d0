"""Checkpoints on disk, without torch or Megatron: the layout of a save directory, its
tracker, each checkpoint's metadata and health mark. Which checkpoint a run resumes is
:mod:`.resume`'s rule.

Layout of ``train.save_dir`` (default ``<output_dir>/checkpoints``)::

    latest_checkpointed_iteration.txt   the step of the newest published checkpoint (tracker)
    iter_0000500/                       one Megatron distributed checkpoint (torch_dist)
        depthmix.json                   written last: step, layout, format, model record,
                                        health mark, size/checksum of every other file;
                                        marks it complete
        tokenizer.json                  the run's tokenizer (when it has a file)
        common.pt, metadata.json, *.distcp, ...
    wandb_run_id.txt                    the W&B run this directory's training logs to
    wandb_group.txt                     its W&B group (evaluations of its checkpoints join it)
    depthmix.lock                       the run that uses the directory (:mod:`.guard`)

**Write, then publish.** Every rank writes its shards into ``.tmp_iter_0000500``; rank 0
then writes ``depthmix.json`` and :func:`publish` renames the directory to
``iter_0000500`` and replaces the tracker atomically (write ``tracker.tmp``, fsync,
``os.replace``). A crash at any point leaves the previous tracker pointing at a complete
checkpoint; leftovers (``.tmp_*``, ``.trash_*``) are ignored and removed by the next save
(:mod:`.retention`). A checkpoint is deleted by renaming it to ``.trash_*`` first
(:func:`remove`), so a half-deleted directory never looks like a checkpoint.

**Health marks.** ``health`` in ``depthmix.json`` is written at save (the last step's loss
and gradient norm were finite) and settled by the next step (:func:`settle_health`):
``confirmed`` when it is finite, demoted to unhealthy when it is not (its weights gave
NaN/inf). A checkpoint without a mark counts as healthy and confirmed.

**Which directory a path names** (:func:`checkpoint_dir`): every command that takes a
checkpoint (``eval.checkpoint``, ``depthmix-generate``, ``depthmix-export``,
``train.load_dir``) takes one ``iter_*`` directory, a save directory, or the output
directory of a training run or of ``depthmix-import`` (its ``checkpoints/``). A directory
that is none of these is refused naming the closest checkpoint directory below it
(:func:`no_checkpoint_error`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Optional

from depthmix.config.schema import ConfigError

log = logging.getLogger("depthmix")

TRACKER = "latest_checkpointed_iteration.txt"
META = "depthmix.json"
TOKENIZER = "tokenizer.json"
RUN_SUBDIR = "checkpoints"
"""The save directory in a run's output directory (:func:`default_save_dir`) and in an
import's (``depthmix-import``)."""
RUN_ID_FILE = "wandb_run_id.txt"
GROUP_FILE = "wandb_group.txt"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp_iter_"
TRASH_PREFIX = ".trash_"


# ---------------------------------------------------------------------------------------
# Paths and metadata
# ---------------------------------------------------------------------------------------


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def tmp_dir(root: str, step: int) -> str:
    """Where the checkpoint of ``step`` is written before it is published."""
    return os.path.join(root, f"{TMP_PREFIX}{step:07d}")


def default_save_dir(run) -> str:
    return run.train.save_dir or os.path.join(run.output_dir, RUN_SUBDIR)


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def write_meta(path: str, meta: dict) -> None:
    """Rank 0, last of a checkpoint's files: ``depthmix.json`` (this marks it complete)."""
    _write_atomic(os.path.join(path, META), json.dumps(meta, indent=2))
    _fsync_dir(path)


def meta_or_none(path: str) -> Optional[dict]:
    try:
        return read_meta(path)
    except (OSError, ValueError) as e:
        log.warning("%s/%s is unreadable (%s): checkpoint ignored", path, META, e)
        return None


def list_checkpoints(root: str) -> list:
    """Complete ``iter_*`` directories of ``root`` as (step, path), oldest first."""
    out = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.startswith("iter_") and name[5:].isdigit() and is_complete(path):
                out.append((int(name[5:]), path))
    return sorted(out)


def writes_in_progress(root: str) -> bool:
    """Whether ``root`` holds a checkpoint being written (a temporary directory)."""
    return os.path.isdir(root) and any(n.startswith(TMP_PREFIX) for n in os.listdir(root))


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


def holds_checkpoints(path: str) -> bool:
    """``path`` is one complete checkpoint or a save directory (a tracker or a complete
    ``iter_*`` directory in it)."""
    return os.path.isdir(path) and (is_complete(path) or bool(list_checkpoints(path))
                                    or os.path.isfile(os.path.join(path, TRACKER)))


def checkpoint_dir(path: Optional[str]) -> Optional[str]:
    """The checkpoint directory a user's ``path`` names: ``path`` itself when it is one
    checkpoint or a save directory, else its ``checkpoints/`` when that is one (the output
    directory of a training run or of ``depthmix-import``); None when neither is."""
    if not path:
        return None
    for candidate in (path, os.path.join(path, RUN_SUBDIR)):
        if holds_checkpoints(candidate):
            return candidate
    return None


def closest_checkpoint_dir(path: str, max_depth: int = 6,
                           max_dirs: int = 5000) -> Optional[str]:
    """The checkpoint directory nearest below ``path`` (fewest levels down; of those the
    most recently modified), or None within ``max_depth`` levels and ``max_dirs``
    directories (a hint for a wrong path, not a search of the disk). Hidden directories
    (``.tmp_*``, ``.trash_*``) are skipped; symbolic links are followed once."""
    level, seen = [path], {os.path.realpath(path)}
    for _ in range(max_depth):
        found, below = [], []
        for parent in level:
            try:
                entries = sorted(os.scandir(parent), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.name.startswith(".") or not entry.is_dir():
                        continue
                except OSError:
                    continue
                real = os.path.realpath(entry.path)
                if real in seen or len(seen) >= max_dirs:
                    continue
                seen.add(real)
                (found if holds_checkpoints(entry.path) else below).append(entry.path)
        if found:
            return max(found, key=_mtime)
        level = below
    return None


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def no_checkpoint_error(path: str, option: str) -> ConfigError:
    """What a directory without a checkpoint is told: what was looked for, and the closest
    checkpoint directory below it."""
    closest = closest_checkpoint_dir(path)
    hint = (f"; the closest checkpoint directory below it: {option}={closest}" if closest
            else "; there is none below it either")
    return ConfigError(f"{option}={path} holds no checkpoint (looked for {TRACKER}, "
                       f"a complete iter_* directory or {META}, in it and in its "
                       f"{RUN_SUBDIR}/){hint}")


def find_checkpoint(path: str, option: str = "checkpoint") -> str:
    """The complete checkpoint ``path`` names for evaluation, generation and export: a
    save directory's latest, one ``iter_*`` directory, or the latest in the ``checkpoints/``
    of a training run's or an import's output directory (:func:`checkpoint_dir`); a
    :class:`ConfigError` naming ``option`` when there is none (with the closest checkpoint
    directory below ``path``) or it holds no model record."""
    if not path or not os.path.exists(path):
        raise ConfigError(f"{option}={path}: no such directory")
    found = latest_checkpoint(checkpoint_dir(path))
    if found is None:
        raise no_checkpoint_error(path, option)
    if "record" not in read_meta(found):
        raise ConfigError(f"{option}={found} predates model records in checkpoints "
                          f"({META} has no 'record'); re-save it with this version")
    return found


def copy_tokenizer(path: str, tokenizer: Optional[str]) -> None:
    """Rank 0: the run's tokenizer file travels with the weights, so evaluation, generation
    and export need only the checkpoint."""
    if tokenizer and os.path.isfile(tokenizer):
        shutil.copyfile(tokenizer, os.path.join(path, TOKENIZER))


def tokenizer_file(path: str) -> Optional[str]:
    """The tokenizer saved with the checkpoint ``path``, or None (runs on synthetic data)."""
    file = os.path.join(path, TOKENIZER)
    return file if os.path.isfile(file) else None


def _read_line(root: str, name: str) -> Optional[str]:
    try:
        with open(os.path.join(root, name)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _write_line(root: str, name: str, text: str) -> None:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, name)
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def read_run_id(root: str) -> Optional[str]:
    """The W&B run that the training in save directory ``root`` logs to, or None."""
    return _read_line(root, RUN_ID_FILE)


def write_run_id(root: str, run_id: str) -> None:
    _write_line(root, RUN_ID_FILE, run_id)


def read_group(root: str) -> Optional[str]:
    """The W&B group of the training in save directory ``root`` (its evaluations join it)."""
    return _read_line(root, GROUP_FILE)


def write_group(root: str, group: str) -> None:
    _write_line(root, GROUP_FILE, group)


# ---------------------------------------------------------------------------------------
# Publishing and removing
# ---------------------------------------------------------------------------------------


def publish(root: str, step: int) -> str:
    """Rank 0: make the written :func:`tmp_dir` of ``step`` the checkpoint of ``step`` (a
    checkpoint of the same step saved before, e.g. by a re-run, is replaced), then point the
    tracker at it. Returns its path."""
    final = step_dir(root, step)
    if os.path.exists(final):
        remove(final)
    os.rename(tmp_dir(root, step), final)
    _fsync_dir(root)
    _write_atomic(os.path.join(root, TRACKER), str(step))
    return final


def remove(path: str) -> None:
    """Rename out of the way (so it never looks like a checkpoint), then delete."""
    if not os.path.exists(path):
        return
    trash = os.path.join(os.path.dirname(path),
                         f"{TRASH_PREFIX}{os.path.basename(path)}_{time.time_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


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


# ---------------------------------------------------------------------------------------
# Health marks
# ---------------------------------------------------------------------------------------


def health(path: str) -> Optional[dict]:
    """The health mark of the checkpoint ``path`` (``{}`` when it has none), or None when
    its metadata is unreadable."""
    meta = meta_or_none(path)
    return None if meta is None else meta.get("health", {})


def is_healthy(path: str) -> bool:
    """Saved after a finite step (checkpoints without a health mark count as healthy)."""
    mark = health(path)
    return mark is not None and mark.get("healthy", True)


def set_health(path: str, **fields) -> None:
    """Rank 0: update the health mark of a published checkpoint (atomic rewrite of its
    ``depthmix.json``)."""
    meta = read_meta(path)
    meta.setdefault("health", {}).update(fields)
    _write_atomic(os.path.join(path, META), json.dumps(meta, indent=2))


def settle_health(path: str, step: int, finite: bool) -> None:
    """Rank 0: step ``step``, the first after the checkpoint ``path`` was saved, was
    ``finite``: the checkpoint is confirmed, else demoted (its weights gave NaN/inf)."""
    try:
        if finite:
            set_health(path, confirmed=True)
        else:
            set_health(path, healthy=False, confirmed=False,
                       note=f"step {step} after it was non-finite")
    except OSError as e:
        log.warning("could not update the health mark of %s: %s", path, e)


# ---------------------------------------------------------------------------------------
# Start-up checks (before any process group or model exists)
# ---------------------------------------------------------------------------------------


def check_save_dir(run) -> None:
    """The save directory is a writable directory, or its nearest existing parent is."""
    path = os.path.abspath(os.path.expanduser(default_save_dir(run)))
    option = "train.save_dir" if run.train.save_dir else "output_dir (checkpoints/ in it)"
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{option}: {path} cannot be created: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = ("is not writable" if probe == path
                else f"cannot be created ({probe} is not writable)")
        raise ConfigError(f"{option}: {path} {what}")
