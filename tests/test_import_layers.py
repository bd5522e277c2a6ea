"""The import structure follows the layer map of docs/ARCHITECTURE.md ("Layers"): a module imports only
from its own layer and the layers listed before it, and no modules import each other in a circle.

Every import statement counts, inside functions too (a lazy import is still a dependency), except those
under ``if TYPE_CHECKING:``. ``from pkg import name`` depends on ``pkg.name`` when that is a module, else on
``pkg``'s ``__init__`` (also from inside ``pkg``: the circle of a package that imports its submodules and
a submodule that takes a name from the package). Importing ``a.b.c`` also runs the ``__init__`` of ``a``
and ``a.b``, so a package's ``__init__`` that imports anything counts as a dependency of whoever imports
its submodules from outside.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megarlhf", "model_providers", "parallel")
# map entries that name one module only, not the modules under it: the bare "megarlhf" is the package's
# __init__, so that a new megarlhf.<something> must be placed in the map rather than falling into "core"
EXACT_ENTRIES = ("megarlhf",)


def read_layer_map(text: str) -> list[tuple[str, list[str]]]:
    """``[(layer name, [module prefixes])]``, lowest first, from the fenced block under "## Layers"."""
    section = text.split("\n## Layers", 1)[1]
    block = section.split("```", 2)[1]
    layers = []
    for line in block.splitlines():
        match = re.match(r"\s*\d+\s+([\w-]+):\s+(.+)$", line)
        if match:
            layers.append((match.group(1), match.group(2).split()))
        elif line.strip():  # a layer's list continued on the next line
            layers[-1][1].extend(line.split())
    return layers


def module_files(root: Path) -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """``(line, dotted name, its package)`` of every import outside ``if TYPE_CHECKING:`` bodies; for
    ``import a.b`` the package is ``a.b`` itself."""
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
               for statement in block.body for node in ast.walk(statement)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names += [(node.lineno, f"{base}.{alias.name}", base) for alias in node.names]
    return names


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the library's own modules."""
    files = module_files(root)

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    def has_imports(module: str) -> bool:
        return any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(ast.parse(files[module].read_text())))

    graph = {}
    for module, path in files.items():
        edges = {}
        for line, name, package in _imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            target = name if name in files else resolve(package)  # a submodule, else a name from the package
            if target is None:
                continue
            parts = target.split(".")
            ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
            implicit = [a for a in ancestors if a in files and has_imports(a) and not module.startswith(a + ".")]
            for dep in [target, *implicit]:
                if dep != module:
                    edges.setdefault(dep, line)
        graph[module] = edges
    return graph


def layer_of(module: str, layers) -> int | None:
    """The index of the layer whose longest matching entry covers ``module`` (None: not in the map)."""
    best = None
    for index, (_, entries) in enumerate(layers):
        for entry in entries:
            covers = module == entry or (module.startswith(entry + ".") and entry not in EXACT_ENTRIES)
            if covers and (best is None or len(entry) > len(best[1])):
                best = (index, entry)
    return None if best is None else best[0]


def layer_violations(graph, layers) -> list[str]:
    found = [f"{module}: not in the layer map" for module in graph if layer_of(module, layers) is None]
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            here, there = layer_of(module, layers), layer_of(target, layers)
            if here is None or there is None:
                found.append(f"{module if here is None else target}: not in the layer map")
            elif there > here:
                found.append(f"{module} (line {line}, layer {layers[here][0]}) imports {target} "
                             f"(layer {layers[there][0]}, above it)")
    return sorted(set(found))


def import_circles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1; stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop(); on_stack.discard(member); component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


LAYERS = read_layer_map((ROOT / "docs" / "ARCHITECTURE.md").read_text())


def test_the_library_follows_the_layer_map():
    graph = import_graph(ROOT)
    assert len(LAYERS) >= 8 and len(graph) > 100 and sum(map(len, graph.values())) > 300
    violations = layer_violations(graph, LAYERS)
    assert not violations, "imports against docs/ARCHITECTURE.md's layer map:\n" + "\n".join(violations)
    circles = import_circles(graph)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(map(str, circles))


@pytest.mark.parametrize("where, bad_import, expected", [
    ("parallel/config.py", "from megarlhf.loops.rl import run_rl", "imports megarlhf.loops.rl"),  # upward
    ("parallel/config.py", "from parallel.runtime import init_parallel", "circle"),  # config <-> runtime
    # the package imports its architecture files; one of them taking a name from the package closes a circle
    ("model_providers/llama.py", "from model_providers import get_provider", "circle"),
    ("megarlhf/newthing.py", "import os", "megarlhf.newthing: not in the layer map"),
])
def test_the_check_fails_on_an_import_that_breaks_the_map(tmp_path, where, bad_import, expected):
    import shutil

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    module = tmp_path / where
    module.write_text((module.read_text() if module.exists() else "") + f"\n\ndef _breaks_the_map():\n    {bad_import}\n")
    graph = import_graph(tmp_path)
    name = where.removesuffix(".py").replace("/", ".")
    found = "\n".join(layer_violations(graph, LAYERS)) + "".join(" circle" for c in import_circles(graph) if name in c)
    assert expected in found
