"""Every tensor megarlhf creates lives on the runtime's device unless the code says why not.

A static check over ``megarlhf/`` and ``parallel/``: a torch factory call (``torch.tensor``, ``zeros``,
``ones``, ``arange``, ``empty``, ``full``, ``rand*``, ``as_tensor``, ``linspace``, ``eye``) must name its
``device=``, or carry a ``# host: <reason>`` comment on one of its lines (host bookkeeping, host-side
index tables, bytes for a gloo channel, offload buffers). On a CPU-only machine a missing device is
invisible at run time (everything is on the CPU), so this check is what fails when one is forgotten;
``*_like`` / ``new_*`` factories inherit their input's device and need nothing.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {"tensor", "zeros", "ones", "arange", "empty", "full", "rand", "randn", "randint", "as_tensor",
             "linspace", "eye", "randperm"}


def factory_calls_without_device(source: str) -> list[tuple[int, str]]:
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)
                and not any("# host:" in line for line in lines[node.lineno - 1:node.end_lineno])):
            found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_the_check_catches_a_factory_without_device():
    assert factory_calls_without_device("import torch\nx = torch.zeros(3)\n") == [(2, "x = torch.zeros(3)")]
    assert factory_calls_without_device("import torch\nx = torch.zeros(3, device=d)\n") == []
    assert factory_calls_without_device("import torch\nx = torch.zeros(3)  # host: a host table\n") == []
    assert factory_calls_without_device("import torch\nx = torch.zeros_like(y)\n") == []


def test_every_factory_in_the_library_names_its_device():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {text}"
                 for package in ("megarlhf", "parallel") for path in sorted((ROOT / package).rglob("*.py"))
                 for line, text in factory_calls_without_device(path.read_text())]
    assert not offenders, "tensor factories without device= (or a '# host:' reason):\n" + "\n".join(offenders)
