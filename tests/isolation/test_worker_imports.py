"""The reward and tool worker processes start light: a timed-out call replaces its worker with a fresh
interpreter, so whatever the pools' resolvers import is paid once per timeout (torch alone is ~1 s here,
which turned 100 hanging calls on 4 workers from 12 s into 64 s). The config package, which every entry
point loads first, stays torch-free for the same reason."""
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "transformers", "megatron")


@pytest.mark.parametrize("module", ["megarlhf.rewards.api", "megarlhf.envs.runner", "megarlhf.config",
                                    "megarlhf.isolation.process_pool", "megarlhf.isolation.sandbox_harness"])
def test_a_worker_resolver_imports_no_heavy_library(module):
    probe = (f"import sys, {module}\n"
             f"print(sorted({{name.split('.')[0] for name in sys.modules}} & set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module} loads {out.strip()}"
