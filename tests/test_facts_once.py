"""Facts written once in ``depthmix/`` (read from the source with ``ast``): the head width's
fallback, the vocabulary padding, the devices' peak FLOP/s, the byte formatter, the
``.idx`` header, the default save directory and the exit statuses each have one home; a
second copy fails here, naming where it is."""

import ast
import pathlib
from functools import lru_cache
from typing import Callable, Dict, Iterator, List

import pytest

import depthmix

ROOT = pathlib.Path(depthmix.__file__).parent
BINARY_UNITS = {"KiB", "MiB", "GiB", "TiB"}
PEAK_TFLOPS = {989.4, 989.0, 835.0, 756.0, 494.7, 312.0}
"""Dense tensor-core peaks of the device table (H100/H200, H100 NVL, H100 PCIe, TF32, A100)."""


def _attr(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name


def head_dim_fallback(node: ast.AST) -> bool:
    """``hidden_size // num_attention_heads`` (or ``/``)."""
    return (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Div))
            and _attr(node.left, "hidden_size") and _attr(node.right, "num_attention_heads"))


def vocab_padding(node: ast.AST) -> bool:
    """Code that reads ``make_vocab_size_divisible_by`` (setting it, or naming it in a
    message, is not padding)."""
    return (_attr(node, "make_vocab_size_divisible_by") and isinstance(node.ctx, ast.Load)
            and not getattr(node, "in_message", False))


def device_peak(node: ast.AST) -> bool:
    """A peak of the device table written as a number, in TFLOP/s or FLOP/s."""
    if not (isinstance(node, ast.Constant) and type(node.value) in (int, float)):
        return False
    return any(abs(node.value - p * scale) <= 1e-9 * p * scale
               for p in PEAK_TFLOPS for scale in (1, 1e12))


def byte_formatting(node: ast.AST) -> bool:
    """A ladder of binary units (two or more in one tuple, list or dict), or an f-string
    that divides a number and labels it with a binary unit."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
        items = node.keys if isinstance(node, ast.Dict) else node.elts
        units = {n.value for n in items if isinstance(n, ast.Constant) and n.value in BINARY_UNITS}
        return len(units) >= 2
    if isinstance(node, ast.JoinedStr):
        labelled = any(isinstance(v, ast.Constant) and set(str(v.value).split()) & BINARY_UNITS
                       for v in node.values)
        divides = any(isinstance(v, ast.FormattedValue)
                      and any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.FloorDiv))
                              for n in ast.walk(v.value))
                      for v in node.values)
        return labelled and divides
    return False


def idx_header(node: ast.AST) -> bool:
    """The magic bytes of Megatron's ``.idx`` (whoever parses the header compares them)."""
    return isinstance(node, ast.Constant) and isinstance(node.value, bytes) \
        and node.value.startswith(b"MMIDIDX")


def default_save_dir(node: ast.AST) -> bool:
    """``<output_dir>/checkpoints``: a call that joins ``"checkpoints"`` onto a path, or a
    name bound to ``"checkpoints"`` (what such a call joins)."""
    if isinstance(node, ast.Assign):
        return isinstance(node.value, ast.Constant) and node.value.value == "checkpoints"
    return (isinstance(node, ast.Call) and _attr(node.func, "join")
            and any(isinstance(a, ast.Constant) and a.value == "checkpoints" for a in node.args))


EXIT_STATUSES = {1, 2, 3, 130}


def exit_status(node: ast.AST) -> bool:
    """An exit status written as a number: ``sys.exit(2)``, ``os._exit(130)``,
    ``SystemExit(3)``, or a constant named like one (``EXIT_DIVERGED = 3``)."""
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
            node.func, "id", "")
        return name in ("exit", "_exit", "SystemExit") and any(
            isinstance(a, ast.Constant) and a.value in EXIT_STATUSES for a in node.args)
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        return node.value.value in EXIT_STATUSES | {0} and any(
            n.isupper() and ("EXIT" in n or n in ("CONFIG_ERROR", "DIVERGED", "INTERRUPTED"))
            for n in names)
    return False


FACTS: Dict[str, tuple] = {
    # fact: (matcher, the one file that may hold it)
    "head-width fallback": (head_dim_fallback, "config/schema.py"),
    "vocabulary padding": (vocab_padding, "config/schema.py"),
    "device peaks": (device_peak, "planning/hardware.py"),
    "byte formatting": (byte_formatting, "planning/units.py"),
    ".idx header": (idx_header, "data/index_file.py"),
    "default save directory": (default_save_dir, "checkpoint/store.py"),
    "exit statuses": (exit_status, "runtime/exit_codes.py"),
}


def _nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node, with those inside f-strings and raise/log messages marked
    ``in_message`` (naming an option in a message is not computing it)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for inner in ast.walk(node):
                if inner is not node:
                    inner.in_message = True
        yield node


@lru_cache(maxsize=None)
def _source_nodes() -> List[tuple]:
    return [(path.relative_to(ROOT).as_posix(), list(_nodes(ast.parse(path.read_text()))))
            for path in sorted(ROOT.rglob("*.py"))]


def places(matcher: Callable[[ast.AST], bool]) -> List[str]:
    return [f"{name}:{node.lineno}" for name, nodes in _source_nodes() for node in nodes
            if matcher(node)]


@pytest.mark.parametrize("fact", list(FACTS))
def test_written_once(fact):
    matcher, home = FACTS[fact]
    found = places(matcher)
    files = sorted({p.split(":")[0] for p in found})
    assert files == [home], f"the {fact} is written in {found}; keep it in {home} only"


def test_the_matchers_see_copies():
    copies = ast.parse("\n".join([
        "kv = m.head_dim or m.hidden_size // m.num_attention_heads",
        "multiple = m.make_vocab_size_divisible_by",
        "padded = -(-m.vocab_size // multiple) * multiple",
        "PEAKS = {'H100': 989e12, 'A100': {'bf16': 312.0}}",
        "UNITS = ('B', 'KiB', 'MiB')",
        "text = f'{n / 2**30:.2f} GiB'",
        "MAGIC = b'MMIDIDX\\x00\\x00'",
        "path = os.path.join(run.output_dir, 'checkpoints')",
        "EXIT_CONFIG_ERROR = 2",
    ]))
    for fact, (matcher, _) in FACTS.items():
        assert any(matcher(n) for n in _nodes(copies)), fact
    message = ast.parse("raise E(f'{m.make_vocab_size_divisible_by}, {kind.memory_gib:.1f} GiB')")
    assert not any(vocab_padding(n) or byte_formatting(n) for n in _nodes(message))
