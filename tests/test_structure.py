"""The package's shape, read from its own source with `ast` (nothing is imported): no import
cycle among megatron_lev modules, no import from a lower layer to a higher one, and no file
over 600 lines. Every import counts, those inside functions included.

The layers, top to bottom (docs/layout.md draws the same picture):

    apps          train.py, evaluate.py, demo.py, cli.py, flag_table.py (entry points)
    evaluation/   the papers' analyses
    hf/           Hugging Face export / import
    launcher/     the Slurm launcher (batch arithmetic, commands, requeue decisions)
    training/ megatron_lm/  arguments, validation, engine, loop; Megatron-LM's model provider
    checkpointing/ save / resume, layouts, conversion, safe loading
    models/ data/ the decoder; tokenizers, corpora, datasets
    lev/ distributed/  the LEV generator; process groups and RNG
    utils/ configs/    foundations

A module may import from its own package (or, for the apps, from another app) and from any
lower layer; the cycle check covers imports within a layer.
"""
from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_lev"
MAX_LINES = 600
LAYERS = (  # top to bottom; a top-level module of the package is in "apps"
    ("apps",),
    ("evaluation",),
    ("hf",),
    ("launcher",),
    ("training", "megatron_lm"),
    ("checkpointing",),
    ("models", "data"),
    ("lev", "distributed"),
    ("utils", "configs"),
)


def package_modules(root: str, package: str = PACKAGE) -> dict[str, str]:
    """Dotted module name -> file, for every .py file of the package under `root`."""
    modules = {}
    for folder, dirs, files in os.walk(os.path.join(root, package)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    return modules


def imports_of(module: str, path: str, modules: dict[str, str], package: str = PACKAGE) -> set[str]:
    """The package modules `module` imports anywhere in its file (functions included).
    `from a.b import c` counts as a.b.c when that is a module, else as a.b."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    resolved = set()
    for name in found:
        while name and name not in modules:  # a name inside a module, or an absent module (an export's `.lev`)
            name = name.rpartition(".")[0]
        if name.startswith(package) and name != module:
            resolved.add(name)
    return resolved


def import_graph(root: str, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = package_modules(root, package)
    return {m: imports_of(m, path, modules, package) for m, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit_of(module: str, root: str, package: str = PACKAGE) -> str:
    """The package a module belongs to (its first component below megatron_lev); "apps" for
    the package's top-level modules (and the package itself)."""
    parts = module.split(".")
    if len(parts) > 1 and os.path.isdir(os.path.join(root, package, parts[1])):
        return parts[1]
    return "apps"


def upward_imports(graph: dict[str, set[str]], root: str, layers=LAYERS, package: str = PACKAGE) -> list[str]:
    """Every import from a lower layer to a higher one (or to the same layer's other package),
    as "module -> module (layer -> layer)"."""
    rank = {unit: i for i, units in enumerate(layers) for unit in units}
    bad = []
    for source, targets in sorted(graph.items()):
        su = unit_of(source, root, package)
        for target in sorted(targets):
            tu = unit_of(target, root, package)
            if su == tu:
                continue
            if su not in rank or tu not in rank:
                bad.append(f"{source} -> {target} (a package with no layer: add it to LAYERS)")
            elif rank[tu] <= rank[su]:
                bad.append(f"{source} -> {target} ({su} imports {tu}, which is not below it)")
    return bad


def long_files(root: str, folders=(PACKAGE, "tests", "tools", "benchmarks", "experiments")) -> list[str]:
    found = []
    for top in folders:
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            # experiments/out: run outputs (git-ignored), e.g. DeepSpeed's zero_to_fp32.py in checkpoints
            dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.join(folder, d) != os.path.join(
                root, "experiments", "out")]
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        count = sum(1 for _ in f)
                    if count > MAX_LINES:
                        found.append(f"{os.path.relpath(path, root)}: {count} lines")
    return found


# --------------------------------------------------------------------------- the checks themselves


def _write(root, rel: str, text: str) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def test_the_checker_finds_cycles_upward_and_function_local_imports_and_long_files(tmp_path):
    root = str(tmp_path)
    _write(root, "pkg/__init__.py", "")
    _write(root, "pkg/app.py", "from pkg.high import a\n")  # downward: fine
    _write(root, "pkg/high/__init__.py", "")
    _write(root, "pkg/high/a.py", "from pkg.low import b\nfrom . import c\n")  # relative import of a module
    _write(root, "pkg/high/c.py", "def f():\n    from pkg.high.a import x\n")  # cycle a <-> c, in a function
    _write(root, "pkg/low/__init__.py", "")
    _write(root, "pkg/low/b.py", "def g():\n    import pkg.high.c\n" + "x = 1\n" * MAX_LINES)  # upward, too long
    graph = import_graph(root, "pkg")
    assert graph["pkg.high.a"] == {"pkg.low.b", "pkg.high.c"}
    assert graph["pkg.high.c"] == {"pkg.high.a"}
    assert graph["pkg.low.b"] == {"pkg.high.c"}
    assert cycles(graph) == [["pkg.high.a", "pkg.high.c", "pkg.low.b"]]
    assert upward_imports(graph, root, (("apps",), ("high",), ("low",)), "pkg") == [
        "pkg.low.b -> pkg.high.c (low imports high, which is not below it)"]
    assert long_files(root, ("pkg",)) == [f"pkg{os.sep}low{os.sep}b.py: {MAX_LINES + 2} lines"]


# --------------------------------------------------------------------------- the package


@pytest.fixture(scope="module")
def graph():
    return import_graph(REPO)


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_every_import_goes_down_the_layers(graph):
    assert upward_imports(graph, REPO) == []


def test_every_package_has_a_layer(graph):
    units = {unit_of(m, REPO) for m in graph}
    assert units == {unit for layer in LAYERS for unit in layer}


def test_no_file_over_600_lines():
    assert long_files(REPO) == []
