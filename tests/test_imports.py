"""Package layering: production code does not depend on the test helpers."""

import ast
import pathlib

import depthmix

ROOT = pathlib.Path(depthmix.__file__).parent
HELPERS = "depthmix.testing"


def imported_modules(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_production_code_does_not_import_the_test_helpers():
    offenders = [
        str(path.relative_to(ROOT.parent))
        for path in sorted(ROOT.rglob("*.py"))
        if path != ROOT / "testing.py"
        and any(m == HELPERS or m.startswith(HELPERS + ".") for m in imported_modules(path))
    ]
    assert not offenders, f"{HELPERS} is imported by {offenders}"
