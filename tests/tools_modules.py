"""The scripts under ``tools/`` imported as modules, for tests that call their functions, and
the cells of the Markdown tables they (and ``summary.md``) hold."""

import importlib.util
import os

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")


def load_tool(name: str):
    """``tools/<name>.py`` as a fresh module (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markdown_rows(text: str) -> list:
    """The cells of a Markdown table's lines (stripped), its alignment row left out."""
    return [[cell.strip() for cell in line.strip()[1:-1].split("|")]
            for line in text.splitlines()
            if line.startswith("|") and not set(line) <= set("|:- ")]
