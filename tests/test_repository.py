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
