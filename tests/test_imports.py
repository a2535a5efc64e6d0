"""Package layering, from the imports of ``depthmix/`` (parsed with ``ast``): production
code does not depend on the test helpers; no module imports itself back, not even through an
import inside a function (such an import only moves a circle's failure to run time);
``config`` and ``planning`` sit below ``megatron_ext``, ``data`` and ``pretrain`` in their
module-level imports (those under ``if``/``try``/``with`` and in class bodies count, those
in function bodies do not), and importing them loads neither Megatron nor (``planning``)
torch. With function-level imports counted: ``kernels`` is a leaf (it imports nothing of
depthmix but itself and ``config``); below the mixers' layer nothing looks a mixer up by
name (imports ``depthmix.mixers`` or calls ``get_mixer``) but config resolving a name: what
a module there needs of a mixer it is handed; only tooling imports ``depthmix.bench``."""

import ast
import json
import pathlib
import subprocess
import sys
import textwrap
from functools import lru_cache
from typing import Dict, List, Optional, Set

import pytest

import depthmix

ROOT = pathlib.Path(depthmix.__file__).parent
HELPERS = "depthmix.testing"
LOWER = ("depthmix.config", "depthmix.planning")
UPPER = ("depthmix.megatron_ext", "depthmix.data", "depthmix.pretrain")
KERNELS = "depthmix.kernels"
KERNELS_READ = ("depthmix.kernels", "depthmix.config")
"""All ``depthmix.kernels`` may import of depthmix."""
BELOW_MIXERS = ("depthmix.config", "depthmix.planning", "depthmix.checkpoint",
                "depthmix.megatron_ext", "depthmix.kernels", "depthmix.data", "depthmix.runtime")
RESOLVERS = ("depthmix.config.load", "depthmix.config.store")
"""Config turning a mixer's name into its config class: the one lookup below the mixers."""
MIXERS = "depthmix.mixers"
BENCH = "depthmix.bench"


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


# ---------------------------------------------------------------------------------------
# The module-level import graph
# ---------------------------------------------------------------------------------------


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module, in_functions: bool = False):
    """Import statements that run when the module is imported; with ``in_functions``
    also those that run when a function of it is called."""
    todo: List[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif in_functions or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda)):
            todo.extend(n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)
                        or isinstance(n, ast.excepthandler))


def _ancestors(module: str) -> List[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@lru_cache(maxsize=None)
def _files() -> Dict[str, pathlib.Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_main_block(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare)
            and getattr(test.left, "id", None) == "__name__" and len(test.comparators) == 1
            and getattr(test.comparators[0], "value", None) == "__main__")


def _library(tree: ast.Module) -> ast.Module:
    """The module without its ``if __name__ == "__main__":`` block, which runs only as the
    program (``python -m``), above every layer: what importing it or calling it runs."""
    tree.body = [node for node in tree.body if not _is_main_block(node)]
    return tree


@lru_cache(maxsize=None)
def import_graph(in_functions: bool = False,
                 programs: bool = True) -> Dict[str, Dict[str, int]]:
    """``{module: {imported depthmix module: line}}``, from module-level imports (and with
    ``in_functions`` those in function bodies too; without ``programs`` not those of a
    ``__main__`` block). Importing ``a.b.c`` runs ``a`` and ``a.b`` first: those count too,
    unless they enclose the importing module."""
    files = _files()
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: Dict[str, int] = {}
        tree = ast.parse(path.read_text())
        for node in _top_level_imports(tree if programs else _library(tree), in_functions):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                for target in [*_ancestors(name), name]:
                    if target in files and target != module and target not in _ancestors(module):
                        edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def _path(graph, start: str, goal) -> Optional[List[str]]:
    """Shortest chain of imports from ``start`` to a module ``goal`` accepts (``start``
    itself included: a cycle)."""
    parent: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t in sorted(graph.get(m, ())):
                if t in parent:
                    continue
                parent[t] = m
                if goal(t):
                    chain, node = [t], parent[t]
                    while node != start:
                        chain.append(node)
                        node = parent[node]
                    return [start, *chain[::-1]]
                nxt.append(t)
        frontier = nxt
    return None


def _describe(graph, chain: List[str]) -> str:
    """``a (depthmix/a.py:12) -> b (...) -> c``: each import with where it is written."""
    files = _files()
    steps = [f"{a} ({files[a].relative_to(ROOT.parent)}:{graph[a][b]})"
             for a, b in zip(chain, chain[1:])]
    return " -> ".join([*steps, chain[-1]])


def _cycles(graph) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_graph_sees_imports_under_if_and_try_but_not_in_functions():
    tree = ast.parse(textwrap.dedent("""
        import a
        if x:
            from b import c
        try:
            import d
        except ImportError:
            import e
        class K:
            import f
        def g():
            import h
    """))
    names = {alias.name for node in _top_level_imports(tree) for alias in node.names}
    assert names == {"a", "c", "d", "e", "f"}
    everywhere = {alias.name for node in _top_level_imports(tree, in_functions=True)
                  for alias in node.names}
    assert everywhere == names | {"h"}
    graph = import_graph()
    # a module, the package it sits in (run first), not the importer's own package
    assert {"depthmix.config", "depthmix.config.schema"} <= set(graph["depthmix.planning.shape"])
    assert "depthmix.planning" not in graph["depthmix.planning.shape"]
    loop = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}}
    assert _cycles(loop) == [["a", "b", "c"]] and not _cycles({"a": {"b": 1}, "b": {}})
    assert _path(loop, "a", lambda t: t == "a") == ["a", "b", "c", "a"]


def test_no_import_cycles():
    """Function-level imports included: one that closes a circle still is one."""
    graph = import_graph(in_functions=True)
    cycles = [_path({m: graph[m] for m in component}, component[0],
                    lambda t, first=component[0]: t == first)
              for component in _cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(
        _describe(graph, chain) for chain in cycles)


def test_config_and_planning_import_nothing_above_them():
    """Not directly and not through another module: a chain of module-level imports from
    ``config`` or ``planning`` to ``megatron_ext``, ``data`` or ``pretrain`` is named."""
    graph = import_graph()
    chains = [_path(graph, m, lambda t: t.startswith(UPPER))
              for m in sorted(graph) if m.startswith(LOWER)]
    offending = [_describe(graph, chain) for chain in chains if chain]
    assert not offending, "imports against the layering:\n" + "\n".join(offending)


def _within(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in
               ([packages] if isinstance(packages, str) else packages))


def kernel_imports_above_config(graph) -> List[str]:
    """``module (line) -> target`` for each import of a kernel module (in ``graph``) of
    depthmix other than the kernels' own and config's."""
    return [f"{m} (line {line}) -> {t}" for m in sorted(graph) if _within(m, KERNELS)
            for t, line in sorted(graph[m].items()) if not _within(t, KERNELS_READ)]


def _calls(tree: ast.AST, name: str) -> List[int]:
    """Lines of the calls of a function ``name`` (``name(...)`` or ``x.name(...)``)."""
    return sorted(n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name))


def mixer_lookups_below(graph, sources: Dict[str, str]) -> List[str]:
    """``module (line): what`` for each module below the mixers' layer (but the resolvers)
    that imports ``depthmix.mixers`` (in ``graph``) or calls ``get_mixer`` (in its source,
    ``sources[module]``)."""
    out = []
    for m in sorted(graph):
        if not _within(m, BELOW_MIXERS) or m in RESOLVERS:
            continue
        out += [f"{m} (line {line}): imports {t}" for t, line in sorted(graph[m].items())
                if _within(t, MIXERS)]
        out += [f"{m} (line {line}): calls get_mixer"
                for line in _calls(_library(ast.parse(sources[m])), "get_mixer")]
    return out


def bench_imports_outside_tooling(graph) -> List[str]:
    return [f"{m} (line {line}) -> {t}" for m in sorted(graph) if not _within(m, BENCH)
            for t, line in sorted(graph[m].items()) if _within(t, BENCH)]


def _sources() -> Dict[str, str]:
    return {m: path.read_text() for m, path in _files().items()}


def test_the_layering_checks_flag_a_violation():
    """Each check, fed a synthetic graph and source with one violation of its rule (and
    an allowed import beside it), names that one."""
    graph = {
        "depthmix.kernels.op.reference": {"depthmix.config.schema": 3,
                                          "depthmix.kernels.modes": 4,
                                          "depthmix.mixers.op": 5},
        "depthmix.planning.cost": {"depthmix.mixers": 7, "depthmix.planning.shape": 8},
        "depthmix.config.load": {"depthmix.mixers": 9},
        "depthmix.cli.run": {"depthmix.mixers": 1, "depthmix.bench.roofline": 2},
        "depthmix.megatron_ext.model": {},
        "depthmix.bench.roofline": {"depthmix.mixers": 1},
    }
    sources = dict.fromkeys(graph, "")
    sources["depthmix.megatron_ext.model"] = "def f(reg):\n    return reg.get_mixer('x')\n"
    sources["depthmix.config.load"] = "from depthmix.mixers import get_mixer\nget_mixer('x')\n"
    sources["depthmix.planning.cost"] = "if __name__ == '__main__':\n    get_mixer('x')\n"
    assert kernel_imports_above_config(graph) == [
        "depthmix.kernels.op.reference (line 5) -> depthmix.mixers.op"]
    assert mixer_lookups_below(graph, sources) == [
        "depthmix.kernels.op.reference (line 5): imports depthmix.mixers.op",
        "depthmix.megatron_ext.model (line 2): calls get_mixer",
        "depthmix.planning.cost (line 7): imports depthmix.mixers"]
    assert bench_imports_outside_tooling(graph) == [
        "depthmix.cli.run (line 2) -> depthmix.bench.roofline"]
    # a function-level import is an edge of the graph these checks read; a program's
    # __main__ block is not (without ``programs``)
    tree = ast.parse("def f():\n    from depthmix.mixers import get_mixer\n"
                     "if __name__ == '__main__':\n    import depthmix.mixers\n")
    assert [n.module for n in _top_level_imports(_library(tree), in_functions=True)] == [
        "depthmix.mixers"]


def test_kernels_import_nothing_of_depthmix_above_config():
    """``depthmix.kernels`` knows tensors, shapes and its own constants (``kernels/modes.py``:
    the option values the mixers offer), never a mixer, the model or a benchmark."""
    offending = kernel_imports_above_config(import_graph(in_functions=True))
    assert not offending, "kernels importing above config:\n" + "\n".join(offending)


def test_nothing_below_the_mixers_looks_a_mixer_up():
    """Planning, checkpoint, the model, kernels, data and the runtime are handed the
    ``Mixer`` (or its model spec and plan); only config resolves a name. A ``__main__``
    block is a program, above every layer (``python -m depthmix.planning.calibration``)."""
    graph = import_graph(in_functions=True, programs=False)
    offending = mixer_lookups_below(graph, _sources())
    assert not offending, "mixer lookups below the mixers' layer:\n" + "\n".join(offending)


def test_only_tooling_imports_bench():
    offending = bench_imports_outside_tooling(import_graph(in_functions=True))
    assert not offending, "depthmix.bench imported outside it:\n" + "\n".join(offending)


# ---------------------------------------------------------------------------------------
# What importing a package loads (a fresh interpreter)
# ---------------------------------------------------------------------------------------

_PROBE = textwrap.dedent("""
    import importlib, json, pkgutil, sys, traceback

    package, forbidden = sys.argv[1], sys.argv[2].split(",")
    seen = {}

    class Watch:
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in forbidden and top not in seen:
                frames = [f for f in traceback.extract_stack()
                          if "/depthmix/" in f.filename.replace("\\\\", "/")]
                seen[top] = [f"{f.filename}:{f.lineno}: {f.line}" for f in frames]
            return None

    sys.meta_path.insert(0, Watch())
    root = importlib.import_module(package)
    modules = [package] + [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
    for name in modules:
        importlib.import_module(name)
    print(json.dumps({"modules": modules, "loaded": seen}))
""")


def _loaded(package: str, forbidden: List[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, package, ",".join(forbidden)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _explain(loaded: dict) -> str:
    return "\n".join(f"{lib} is imported by:\n  " + "\n  ".join(chain or ["(outside depthmix)"])
                     for lib, chain in loaded.items())


@pytest.mark.multiproc(at_once=1)
def test_importing_planning_loads_neither_torch_nor_megatron():
    found = _loaded("depthmix.planning", ["torch", "megatron"])
    assert "depthmix.planning.memory" in found["modules"]
    assert not found["loaded"], _explain(found["loaded"])


@pytest.mark.multiproc(at_once=1)
def test_importing_config_loads_no_megatron():
    found = _loaded("depthmix.config", ["megatron"])
    assert "depthmix.config.load" in found["modules"]
    assert not found["loaded"], _explain(found["loaded"])


@pytest.mark.multiproc(at_once=1)
def test_the_probe_names_the_import_that_loads_a_library():
    found = _loaded("depthmix.runtime", ["psutil"])
    chain = found["loaded"]["psutil"]
    assert chain and all("/depthmix/runtime/" in line for line in chain), chain
