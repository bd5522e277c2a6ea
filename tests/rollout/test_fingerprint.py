"""Weight fingerprints: equal to a plain-Python statement of the definition, exact under chunking, additive
over the parts of a fused parameter at any offset, and changed by one ulp of one element in every dtype."""
from __future__ import annotations

import pytest
import torch

from megarlhf.rollout.engines import fingerprint as fp_module
from megarlhf.rollout.engines.fingerprint import MODULUS, combine, fingerprint, to_host

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn]


def _random(shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _naive(tensor: torch.Tensor, offset: int = 0) -> tuple[int, int]:
    """The module docstring's definition, byte by byte in Python integers (no wrapping until the end): the
    tensor's bytes sit at byte ``offset * element_size`` of the parameter, read as little-endian words."""
    raw = tensor.contiguous().view(-1).view(torch.uint8).tolist()
    first = offset * tensor.element_size()
    words = {}
    for i, byte in enumerate(raw):
        word, place = divmod(first + i, 4)
        words[word] = words.get(word, 0) + (byte << (8 * place))
    rows = {}
    for word, value in words.items():
        row, column = divmod(word, fp_module.ROW)
        rows[row] = rows.get(row, 0) + value * fp_module._COLUMN_WEIGHTS[column]
    return tuple(sum(s * (((r * a + b) % MODULUS) | 1) for r, s in rows.items()) % MODULUS
                 for a, b in fp_module._ROW_WEIGHTS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_definition(dtype):
    t = _random((5, 29), dtype)
    assert to_host({"t": fingerprint(t)})["t"] == _naive(t)
    assert to_host({"t": fingerprint(t, offset=77)})["t"] == _naive(t, offset=77)
    assert to_host({"t": fingerprint(t[:, 1:], offset=3)})["t"] == _naive(t[:, 1:], offset=3)  # unaligned view


def test_chunks_do_not_change_it(monkeypatch):
    t = _random((300, 7), torch.float32)
    whole = fingerprint(t, offset=3)
    monkeypatch.setattr(fp_module, "CHUNK_LANES", 128)
    assert torch.equal(fingerprint(t, offset=3), whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_parameter_is_the_sum_of_its_parts(dtype):
    # odd sizes: with 1- and 2-byte dtypes the parts share words at their boundaries
    q, k, v = _random((13, 7), dtype, 1), _random((5, 7), dtype, 2), _random((5, 7), dtype, 3)
    parts = [fingerprint(q), fingerprint(k, offset=q.numel()), fingerprint(v, offset=q.numel() + k.numel())]
    assert torch.equal(combine(parts), fingerprint(torch.cat([q, k, v])))
    padded = torch.cat([q, torch.zeros(3, 7, dtype=dtype)])  # vLLM's zero vocabulary padding
    assert torch.equal(fingerprint(padded), fingerprint(q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_ulp_and_moved_values_change_it(dtype):
    t = _random((40, 33), dtype)
    for index in (0, 63, 64, 700, t.numel() - 1):
        u = t.clone()
        u.view(-1)[index] = torch.nextafter(u.view(-1)[index].float(), torch.tensor(float("inf"))).to(dtype) \
            if dtype in (torch.float32, torch.float64) else _next_up(u.view(-1)[index])
        assert not torch.equal(fingerprint(u), fingerprint(t)), (dtype, index)
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert not torch.equal(fingerprint(swapped), fingerprint(t))
    assert not torch.equal(fingerprint(t, offset=1), fingerprint(t))  # the place matters
    assert torch.equal(fingerprint(t.t().contiguous().t()), fingerprint(t))  # values, not strides


def _next_up(value: torch.Tensor) -> torch.Tensor:
    """One ulp up for a narrow float type, through its bits."""
    ints = {1: torch.uint8, 2: torch.int16}[value.element_size()]
    bits = value.view(ints).clone()
    return (bits + 1).view(value.dtype)


def test_to_host_reads_everything_at_once():
    fingerprints = {"a": fingerprint(torch.ones(3)), "b": fingerprint(torch.zeros(3))}
    host = to_host(fingerprints)
    assert host == {"a": tuple(v % MODULUS for v in fingerprints["a"].tolist()), "b": (0, 0)} and to_host({}) == {}


def test_the_triton_kernel_gives_the_same_bits():
    """The GPU path (one Triton kernel per tensor) under Triton's CPU interpreter: every dtype, aligned and
    unaligned offsets, tensors of several row blocks, an empty one."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("_fingerprint_kernel_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"cases": 61, "mismatches": []}


def test_a_lossless_float32_copy_is_fingerprinted_in_the_models_dtype():
    """vLLM's AMX path (CPUs with AMX tiles) keeps a float32 copy of a bf16 layer's bias; the kernel reads
    the bf16 values, so the copy must match the trainer's bf16 prediction, and a float32 value bf16 cannot
    hold (a bias reloaded unrounded from a float32 checkpoint) must not."""
    from megarlhf.rollout.engines.weights import as_model_dtype
    from megarlhf.rollout.engines.fingerprint import fingerprint, to_host

    bias = torch.randn(256, generator=torch.Generator().manual_seed(0))
    trainer = bias.to(torch.bfloat16)
    widened = trainer.to(torch.float32)
    prints = to_host({"trainer": fingerprint(trainer), "widened": fingerprint(as_model_dtype(widened, torch.bfloat16)),
                      "unrounded": fingerprint(as_model_dtype(bias, torch.bfloat16)),
                      "fp32 model": fingerprint(as_model_dtype(widened, torch.float32))})
    assert prints["widened"] == prints["trainer"]
    assert prints["unrounded"] != prints["trainer"]
    assert prints["fp32 model"] != prints["trainer"]  # a float32 model's parameters are compared as they are
    assert as_model_dtype(trainer, torch.bfloat16) is trainer
