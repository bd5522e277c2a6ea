"""The code keeps the shape the project asks of it: no file over 500 lines, no function over 80 lines or
8 parameters (``self``/``cls`` not counted), and only ``parallel/`` reads Megatron's global parallel state
(everything else asks the ``Runtime``, or ``parallel.runtime.model_groups``). Each test lists every
offender it finds."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("megarlhf", "model_providers", "parallel", "tools", "bench", "examples", "tests")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 500, 80, 8


def python_files(roots=SOURCES) -> list[Path]:
    return sorted(p for root in roots for p in (ROOT / root).rglob("*.py"))


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    """A ``@triton.jit`` kernel: its parameters are its launch signature (pointers, sizes, strides and tile
    constants, one by one: Triton passes no structures), so the parameter limit does not apply."""
    return any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)


def _parameters(node: ast.FunctionDef) -> int:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    count = len(names) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (names[:1] in (["self"], ["cls"]))


def shape_offenders(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        text = path.read_text()
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        if len(text.splitlines()) > MAX_FILE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {lines} lines (at most {MAX_FUNCTION_LINES})")
            if _parameters(node) > MAX_PARAMETERS and not _is_triton_kernel(node):
                found.append(f"{name}:{node.lineno} {node.name}: {_parameters(node)} parameters "
                             f"(at most {MAX_PARAMETERS})")
    return found


def parallel_state_readers(files: list[Path]) -> list[str]:
    """Modules outside ``parallel/`` that import Megatron's ``parallel_state``."""
    found = []
    for path in files:
        if path.relative_to(ROOT).parts[0] == "parallel":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith("megatron.core.parallel_state") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_file_function_or_signature_outgrows_the_limits():
    files = python_files()
    assert len(files) > 150
    offenders = shape_offenders(files)
    assert not offenders, "too large:\n" + "\n".join(offenders)


def test_the_check_names_what_outgrows_the_limits(tmp_path):
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    module = tmp_path / "m.py"
    module.write_text(f"def long():\n{long_body}\n\n\ndef wide(a, b, c, d, e, f, g, h, i):\n    pass\n\n\n"
                      "class C:\n    def fine(self, a, b, c, d, e, f, g, h):\n        pass\n\n\n"
                      "@triton.jit\ndef kernel(a, b, c, d, e, f, g, h, i, j):\n    pass\n")
    found = "\n".join(shape_offenders([module]))
    assert f"long: {MAX_FUNCTION_LINES + 1} lines" in found and "wide: 9 parameters" in found
    assert "fine" not in found and "kernel" not in found


def test_only_parallel_reads_megatrons_global_parallel_state():
    offenders = parallel_state_readers(python_files(("megarlhf", "model_providers", "parallel")))
    assert not offenders, "read Megatron's parallel_state outside parallel/:\n" + "\n".join(offenders)
    assert parallel_state_readers([ROOT / "parallel" / "runtime.py"]) == []  # parallel/ itself may
