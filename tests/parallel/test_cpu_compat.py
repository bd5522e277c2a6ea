"""Megatron-Core runs on CPU through parallel.cpu_compat: TP=2 and PP=2 (2 ranks, gloo) equal TP=1.

The reference is the same model at TP=1/PP=1 on the same ranks; the sharded model is loaded with the
reference's weights, so logits and the loss after one AdamW step through Megatron's DDP, optimizer
(plain and distributed) and pipeline schedule must agree to float round-off.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarlhf.testing.launch import read_rank_results, run_torchrun
from parallel import cpu_compat

WORKER = Path(__file__).with_name("_worker_cpu_compat.py")


@pytest.mark.parametrize("tp,pp,dist_opt", [pytest.param(2, 1, False, marks=pytest.mark.slow), (2, 1, True),
                                             pytest.param(1, 2, False, marks=pytest.mark.slow)])
def test_sharded_model_matches_unsharded(tmp_path, tp, pp, dist_opt):
    args = [str(tmp_path), "--tp", str(tp), "--pp", str(pp)] + (["--distributed-optimizer"] if dist_opt else [])
    run_torchrun(WORKER, 2, args)
    for result in read_rank_results(tmp_path, 2):
        if result["logit_max_abs_diff"] is not None:  # PP: only the last stage has logits
            assert result["logit_max_abs_diff"] < 1e-5
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5, abs=1e-6)
        # The step really trained: the loss moved.
        assert abs(result["losses"][1] - result["losses"][0]) > 1e-3
        # patch 8: Megatron's fusions stayed eager, so the rank never imported inductor's compiler (torch's
        # optimizers import dynamo themselves)
        assert result["compiler_imported"] is False


def test_transformer_config_overrides_only_without_cuda():
    overrides = cpu_compat.transformer_config_overrides()
    assert not torch.cuda.is_available()
    assert overrides["use_cpu_initialization"] is True
    assert overrides["gradient_accumulation_fusion"] is False


def test_activate_rewrites_cuda_placements():
    assert cpu_compat.activate()
    t = torch.zeros(3, device="cuda")
    assert t.device.type == "cpu"
    assert t.cuda() is t
    assert t.to(torch.cuda.current_device()).device.type == "cpu"
    assert t.type() == "torch.cuda.FloatTensor"
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.synchronize()


def test_megatron_imports_without_compiling_its_fusions():
    """Patch 8: importing ``parallel`` first leaves Megatron's fusions eager (its fuser off, dynamo never
    imported) and ``torch.compile`` as it was."""
    probe = (
        "import sys, torch; compile_ = torch.compile; import parallel\n"
        "import megatron.core.models.gpt, megatron.core.pipeline_parallel, megatron.core.optimizer\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions.fused_bias_geglu import geglu\n"
        "print(torch.compile is compile_, jit.jit_fuser is jit.noop_decorator, 'torch._dynamo' in sys.modules,\n"
        "      type(geglu).__name__)\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["True", "True", "False", "function"]
