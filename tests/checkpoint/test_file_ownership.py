"""Only ``depthmix/checkpoint/`` touches checkpoint files (issue 24, acceptance 4): no other
module (nor ``tools/``) names the files of a save directory (tracker, ``iter_*``, ``depthmix.json``,
``.tmp_*`` / ``.trash_*``, the lock, the W&B run-id file, a checkpoint's tokenizer), builds
their paths or reads/writes checkpoints with Megatron's dist_checkpointing; they call
:mod:`depthmix.checkpoint.store` / :mod:`~depthmix.checkpoint.distributed` instead.
Scanned with ``ast`` (docstrings and ``#`` comments may describe the layout)."""

import ast
import pathlib
import re

import depthmix
from depthmix.checkpoint import store

ROOT = pathlib.Path(depthmix.__file__).parent
OWNER = ROOT / "checkpoint"
TOOLS = ROOT.parent / "tools"
LOCK = "depthmix.lock"  # depthmix.checkpoint.guard.LOCK (that module imports torch)

FILE_NAMES = (store.TRACKER, store.META, store.RUN_ID_FILE, store.TMP_PREFIX,
              store.TRASH_PREFIX, LOCK)
CHECKPOINT_DIR = re.compile(r"(^|[/\\])iter_")  # a path component, not "one iter_* dir"
NAMES = {"TRACKER", "META", "TOKENIZER", "RUN_ID_FILE", "TMP_PREFIX", "TRASH_PREFIX", "LOCK",
         "step_dir", "tmp_dir", "dist_checkpointing"}
"""Imported from a depthmix module (or Megatron's checkpoint I/O): paths and files that
only the checkpoint package handles."""


def _docstrings(tree: ast.AST) -> set:
    """Bare string statements: module/class/function and attribute docstrings."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def offences(source: str, where: str) -> list:
    """What in ``source`` touches checkpoint files, as ``where:line: what`` lines."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    out = []
    for node in sorted(ast.walk(tree), key=lambda n: (getattr(n, "lineno", 0),
                                                        getattr(n, "col_offset", 0))):
        what = None
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs):
            hit = [n for n in FILE_NAMES if n in node.value]
            if hit or CHECKPOINT_DIR.search(node.value):
                what = f"names a checkpoint file: {node.value!r}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names} & NAMES
            if node.module.startswith("depthmix") and names:
                what = f"imports {sorted(names)} from {node.module}"
            elif node.module == "megatron.core" and "dist_checkpointing" in names:
                what = "imports megatron.core.dist_checkpointing (checkpoint I/O)"
        elif isinstance(node, ast.Import):
            if any(a.name == "megatron.core.dist_checkpointing" for a in node.names):
                what = "imports megatron.core.dist_checkpointing (checkpoint I/O)"
        elif isinstance(node, ast.Attribute) and node.attr in NAMES - {"dist_checkpointing"}:
            what = f"uses .{node.attr}"
        if what:
            out.append(f"{where}:{node.lineno}: {what}")
    return out


def test_only_the_checkpoint_package_touches_checkpoint_files():
    found = []
    for path in sorted([*ROOT.rglob("*.py"), *TOOLS.rglob("*.py")]):
        if OWNER not in path.parents:
            found += offences(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert not found, ("move this into depthmix/checkpoint/ (or call its API):\n"
                       + "\n".join(found))


def test_the_scan_finds_offenders():
    source = '''
"""Docstrings may say iter_0000500/depthmix.json."""
import os
from depthmix.checkpoint.store import TRACKER, read_meta
from megatron.core import dist_checkpointing
from depthmix.checkpoint import store

def latest(root):
    """Reads latest_checkpointed_iteration.txt."""
    os.path.join(root, f"iter_{7:07d}", "depthmix.json")
    open(os.path.join(root, "wandb_run_id.txt")).read()
    return store.step_dir(root, 1), read_meta(root)
'''
    found = offences(source, "x.py")
    assert [line.split(":")[1] for line in found] == ["4", "5", "10", "10", "11", "12"], found
    assert "TRACKER" in found[0] and "dist_checkpointing" in found[1]
    assert "'iter_'" in found[2] and "depthmix.json" in found[3]
    assert "wandb_run_id.txt" in found[4] and ".step_dir" in found[5]
