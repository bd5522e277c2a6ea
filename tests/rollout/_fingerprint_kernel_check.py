"""Run with TRITON_INTERPRET=1 by tests/rollout/test_fingerprint.py: the Triton fingerprint against the
torch one on CPU tensors (Triton's interpreter), one tensor per launch and several staged into one
launch (fingerprint_many, with a staging limit small enough to need several buffers and to send its
largest tensor alone), printing one JSON line of the mismatches."""
import json

import torch

from megarlhf.rollout.engines import fingerprint as fp_module
from megarlhf.rollout.engines.fingerprint import fingerprint, fingerprint_many

cases, mismatches, pairs = 0, [], []
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn):
    for shape, offset in (((5, 29), 0), ((5, 29), 77), ((3, 1), 1), ((129, 70), 0), ((129, 70), 4099), ((0,), 3)):
        t = torch.randn(*shape, generator=gen).to(dtype)
        pairs.append((t, offset))
        cases += 1
        a, b = fingerprint(t, offset, backend="torch"), fingerprint(t, offset, backend="triton")
        if not torch.equal(a, b):
            mismatches.append([str(dtype), list(shape), offset, a.tolist(), b.tolist()])
pairs.append((torch.randn(3, 5, generator=gen)[:, 1:4], 5))  # a strided view
fp_module.STAGING_BYTES = 60_000  # the 129x70 fp32 and fp64 tensors (36, 72 KB) go alone; the rest in 2 buffers
staged = fingerprint_many(pairs, backend="triton")
for (t, offset), value in zip(pairs, staged):
    cases += 1
    if not torch.equal(value, fingerprint(t, offset, backend="torch")):
        mismatches.append(["many", str(t.dtype), list(t.shape), offset])
print(json.dumps({"cases": cases, "mismatches": mismatches}))
