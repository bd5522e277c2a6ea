"""Run with TRITON_INTERPRET=1 by tests/rollout/test_fingerprint.py: the Triton fingerprint against the
torch one on CPU tensors (Triton's interpreter), printing one JSON line of the mismatches."""
import json

import torch

from megarlhf.rollout.fingerprint import fingerprint

cases, mismatches = 0, []
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn):
    for shape, offset in (((5, 29), 0), ((5, 29), 77), ((3, 1), 1), ((129, 70), 0), ((129, 70), 4099), ((0,), 3)):
        t = torch.randn(*shape, generator=gen).to(dtype)
        cases += 1
        a, b = fingerprint(t, offset, backend="torch"), fingerprint(t, offset, backend="triton")
        if not torch.equal(a, b):
            mismatches.append([str(dtype), list(shape), offset, a.tolist(), b.tolist()])
print(json.dumps({"cases": cases, "mismatches": mismatches}))
