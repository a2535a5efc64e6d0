"""Facts written once in ``depthmix/`` and ``tools/`` (read from the source with ``ast``):
the head width's fallback, the vocabulary padding, the devices' peak FLOP/s, the byte
formatter, the ``.idx`` header, the default save directory, the exit statuses and the
precision names with their torch dtypes each have one home; a second copy fails here,
naming where it is."""

import ast
import pathlib
from functools import lru_cache
from typing import Callable, Dict, Iterator, List

import pytest

import depthmix

ROOT = pathlib.Path(depthmix.__file__).parent
SOURCES = (ROOT, ROOT.parent / "tools")
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


PRECISION_NAMES = {"fp32", "bf16", "fp16"}
TORCH_FLOATS = {"float32", "bfloat16", "float16"}


def _precision_part(node: ast.AST) -> str:
    if isinstance(node, ast.Constant) and node.value in PRECISION_NAMES:
        return "name"
    if (isinstance(node, ast.Constant) and node.value in TORCH_FLOATS) or (
            _attr(node, "float32") or _attr(node, "bfloat16") or _attr(node, "float16")):
        return "dtype"
    return ""


def precision_map(node: ast.AST) -> bool:
    """The ``train.precision`` names listed (two or more in one tuple, list or set), or
    paired with torch's dtypes or their names, either way round (two or more pairs in a
    dict display or ``dict(...)`` keywords)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return sum(_precision_part(n) == "name" for n in node.elts) >= 2
    if isinstance(node, ast.Dict):
        pairs = zip(node.keys, node.values)
    elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "dict":
        pairs = ((ast.Constant(k.arg), k.value) for k in node.keywords)
    else:
        return False
    return sum({_precision_part(k), _precision_part(v)} == {"name", "dtype"}
               for k, v in pairs) >= 2


FACTS: Dict[str, tuple] = {
    # fact: (matcher, the one file that may hold it)
    "head-width fallback": (head_dim_fallback, "depthmix/config/schema.py"),
    "vocabulary padding": (vocab_padding, "depthmix/config/schema.py"),
    "device peaks": (device_peak, "depthmix/planning/hardware.py"),
    "byte formatting": (byte_formatting, "depthmix/planning/units.py"),
    ".idx header": (idx_header, "depthmix/data/index_file.py"),
    "default save directory": (default_save_dir, "depthmix/checkpoint/store.py"),
    "exit statuses": (exit_status, "depthmix/runtime/exit_codes.py"),
    "precision names and dtypes": (precision_map, "depthmix/config/validate.py"),
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
    return [(path.relative_to(ROOT.parent).as_posix(), list(_nodes(ast.parse(path.read_text()))))
            for source in SOURCES for path in sorted(source.rglob("*.py"))]


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
        "DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}",
    ]))
    for fact, (matcher, _) in FACTS.items():
        assert any(matcher(n) for n in _nodes(copies)), fact
    message = ast.parse("raise E(f'{m.make_vocab_size_divisible_by}, {kind.memory_gib:.1f} GiB')")
    assert not any(vocab_padding(n) or byte_formatting(n) for n in _nodes(message))



def test_the_precision_matcher_sees_each_shape_of_the_map():
    copies = ["{'fp32': torch.float32, 'bf16': torch.bfloat16}",
              "{'float32': 'fp32', 'bfloat16': 'bf16'}",  # config.json's dtype -> ours
              "dict(fp32=torch.float32, fp16=torch.float16)",
              "choices=('fp32', 'bf16', 'fp16')"]
    for copy in copies:
        assert any(precision_map(n) for n in ast.walk(ast.parse(copy))), copy
    not_maps = ["{'bf16': 989.4, 'fp16': 989.4, 'fp32': 67.0}",  # peaks by precision
                "ok = dtype in (torch.float32, torch.bfloat16, torch.float16)",
                "bf16 = precision == 'bf16'"]
    for other in not_maps:
        assert not any(precision_map(n) for n in ast.walk(ast.parse(other))), other
