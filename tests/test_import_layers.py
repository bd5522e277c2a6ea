"""The import structure follows the layer map of docs/ARCHITECTURE.md ("Layers"), at the granularity of
folders: a module imports only from its own layer and the layers listed before it; no modules import each
other in a circle; and no folders do either (a folder is a node of its own: ``megarlhf.rollout`` and
``megarlhf.rollout.engines`` are two, so a subfolder never needs a module of the folder that holds it).
The modules directly in ``megarlhf/`` (its ``__init__``, ``cli``, ``__main__``) are one node each.

Every import statement counts, inside functions too (a lazy import is still a dependency), and under
``if TYPE_CHECKING:`` too (a reader follows it like any other). ``from pkg import name`` depends on
``pkg.name`` when that is a module, else on
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
ROOT_PACKAGE = "megarlhf"  # its own modules hold only the entry points: each is a node of its own
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
    """``(line, dotted name, its package)`` of every import; for ``import a.b`` the package is ``a.b`` itself."""
    names = []
    for node in ast.walk(tree):
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


def folder_of(module: str, files: dict[str, Path]) -> str:
    """The folder node of ``module``: its package, or itself for a module directly in ``megarlhf/``."""
    if files[module].name == "__init__.py" or module.count(".") == 1 and module.startswith(ROOT_PACKAGE + "."):
        return module
    return module.rpartition(".")[0]


def folder_graph(graph, files) -> dict[str, dict[str, str]]:
    """``{folder: {imported folder: "module -> module"}}``: the module graph seen folder by folder."""
    folders: dict[str, dict[str, str]] = {}
    for module, edges in graph.items():
        here = folder_of(module, files)
        folders.setdefault(here, {})
        for target in edges:
            there = folder_of(target, files)
            if there != here:
                folders[here].setdefault(there, f"{module} -> {target}")
    return folders


LAYERS = read_layer_map((ROOT / "docs" / "ARCHITECTURE.md").read_text())


def structure_problems(root: Path) -> list[str]:
    """Everything the map forbids: modules outside it, upward imports, circles of modules and of folders."""
    files, graph = module_files(root), import_graph(root)
    problems = layer_violations(graph, LAYERS)
    problems += [f"modules that import each other in a circle: {c}" for c in import_circles(graph)]
    folders = folder_graph(graph, files)
    for circle in import_circles(folders):
        links = [folders[a][b] for a in circle for b in circle if b in folders[a]]
        problems.append(f"folders that import each other in a circle: {circle} (through {'; '.join(links)})")
    return problems


def test_the_library_follows_the_layer_map():
    graph = import_graph(ROOT)
    assert len(LAYERS) >= 8 and len(graph) > 100 and sum(map(len, graph.values())) > 300
    assert len(folder_graph(graph, module_files(ROOT))) >= 25
    problems = structure_problems(ROOT)
    assert not problems, "imports against docs/ARCHITECTURE.md's layer map:\n" + "\n".join(problems)


@pytest.mark.parametrize("where, bad_import, expected", [
    ("megarlhf/config/parallel.py", "from megarlhf.loops.rl import train_rl", "imports megarlhf.loops.rl"),  # upward
    ("megarlhf/config/parallel.py", "from parallel.runtime import init_parallel", "imports parallel.runtime"),
    # a type-only import is a dependency too
    ("megarlhf/config/parallel.py", "if TYPE_CHECKING:\n        from megarlhf.learner import TrainModel",
     "imports megarlhf.learner"),
    # the package imports its architecture files; one of them taking a name from the package closes a circle
    ("model_providers/llama.py", "from model_providers import get_provider", "modules that import each other"),
    # no module circle, but the engines folder would need the folder that holds it
    ("megarlhf/rollout/engines/fake.py", "from megarlhf.rollout.colocate import OffloadedModel",
     "megarlhf.rollout.engines.fake -> megarlhf.rollout.colocate"),
    ("megarlhf/newthing.py", "import os", "megarlhf.newthing: not in the layer map"),
])
def test_the_check_fails_on_an_import_that_breaks_the_map(tmp_path, where, bad_import, expected):
    import shutil

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    module = tmp_path / where
    module.write_text((module.read_text() if module.exists() else "") + f"\n\ndef _breaks_the_map():\n    {bad_import}\n")
    assert expected in "\n".join(structure_problems(tmp_path))
