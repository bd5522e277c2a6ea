"""The import structure follows the layer map of docs/ARCHITECTURE.md ("Layers"): a module imports only
from its own layer and the layers listed before it, and no modules import each other in a circle.

Every import statement counts, inside functions too (a lazy import is still a dependency), except those
under ``if TYPE_CHECKING:``. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, so a
package's ``__init__`` that imports anything counts as a dependency of whoever imports its submodules.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megarlhf", "model_providers", "parallel")


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


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import outside ``if TYPE_CHECKING:`` blocks."""
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
               for node in ast.walk(block)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names] + [(node.lineno, base)]
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
        for line, name in _imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            target = resolve(name)
            if target is None:
                continue
            parts = target.split(".")
            ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
            for dep in [target, *(a for a in ancestors if a in files and has_imports(a))]:
                if dep != module and not module.startswith(dep + "."):
                    edges.setdefault(dep, line)
        graph[module] = edges
    return graph


def layer_of(module: str, layers) -> int | None:
    best = None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    return None if best is None else best[0]


def layer_violations(graph, layers) -> list[str]:
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            here, there = layer_of(module, layers), layer_of(target, layers)
            if here is None or there is None:
                found.append(f"{module}: not in the layer map" if here is None else f"{target}: not in the layer map")
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
    assert len(LAYERS) >= 8 and len(graph) > 100
    violations = layer_violations(graph, LAYERS)
    assert not violations, "imports against docs/ARCHITECTURE.md's layer map:\n" + "\n".join(violations)
    circles = import_circles(graph)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(map(str, circles))


@pytest.mark.parametrize("bad_import, expected", [
    ("from megarlhf.trainers.rl import run_rl", "imports megarlhf.trainers.rl"),  # upward: parallel -> trainers
    ("from parallel.runtime import init_parallel", "circle"),  # parallel.config <-> parallel.runtime
])
def test_the_check_fails_on_an_import_that_breaks_the_map(tmp_path, bad_import, expected):
    import shutil

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    config = tmp_path / "parallel" / "config.py"
    config.write_text(config.read_text() + f"\n\ndef _breaks_the_map():\n    {bad_import}\n")
    graph = import_graph(tmp_path)
    found = "\n".join(layer_violations(graph, LAYERS)) + "".join(" circle" for c in import_circles(graph)
                                                               if "parallel.config" in c)
    assert expected in found
