"""The dtype-aware gates on a bf16 trainer with bf16 engines (vLLM and the transformers engine): a correct
sync and a correct rollout pass them; a conversion one bf16 ulp off is refused at calibration; one bf16
ulp in one element and a stale layer stop the sync at the fingerprints; and an engine that holds one
weight tensor mangled by 100 bf16 ulps per element while its fingerprints say otherwise (so only the
probe can see it) fails the probe.

Measured here on the tiny Qwen2; megarlhf/rollout/sync/gates.py's docstring has the demo's SFT model and
SmolLM2-135M-Instruct, whose correct-sync noise is what the calibration scales the tolerances by."""
from pathlib import Path

import pytest

from megarlhf.rollout.sync.gates import FLOORS
from megarlhf.testing.launch import read_rank_results, run_torchrun

WORKER = Path(__file__).with_name("_worker_bf16_gates.py")
BF16 = FLOORS["bfloat16"]


@pytest.fixture(scope="module")
def gates_run(tiny_qwen2, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16_gates")
    run_torchrun(WORKER, 1, [str(tiny_qwen2), str(out), "vllm", "hf"], timeout_s=900)
    return read_rank_results(out, 1)[0]


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_correct_bf16_sync_and_rollout_pass(gates_run, backend):
    r = gates_run[backend]
    tolerances, calibration = r["tolerances"], r["calibration"]
    # the tiny model's rounding noise is below the bf16 floors, so the floors are the tolerances
    assert calibration["gates/calibration_probe_mean"] * 3 < BF16.probe_mean
    assert 0 < calibration["gates/calibration_natural_mean"] * 3 < BF16.step0_mean
    assert calibration["gates/calibration_checkpoint_bitwise"] == 1.0
    assert tolerances == vars(BF16)
    assert 0 < r["sync"]["weight_sync/probe_max_abs_diff"] <= tolerances["probe_max"]
    assert 0 < r["sync"]["weight_sync/probe_mean_abs_diff"] <= tolerances["probe_mean"]
    assert r["step0_tokens"] > 500
    assert r["step0_max"] <= tolerances["step0_max"] and r["step0_mean"] <= tolerances["step0_mean"]
    # bf16 rounding is visible: these are not fp32 numbers, so an fp32 gate would have refused them
    assert r["step0_mean"] > FLOORS["float32"].step0_mean


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_one_ulp_and_a_stale_layer_stop_the_bf16_sync(gates_run, backend):
    faults = gates_run[backend]["bitwise"]
    for case in ("one_ulp", "stale_layer"):
        assert faults[case] is not None, case
        assert faults[case].startswith("weight sync verification failed (fingerprints of the engine's parameters)")
    assert "model.layers.1.mlp.down_proj.weight" in faults["one_ulp"]
    assert "model.layers.1." in faults["stale_layer"]
    # the actor back at the weights of the last verified sync: a failed sync left the engine with others, so
    # this one is sent (seen skipped when a failed sync did not forget what the engine held)
    restored = faults["restored"]
    assert restored["weight_sync/skipped"] == 0.0 and restored["weight_sync/tensors"] > 0


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_calibration_refuses_a_bf16_conversion_one_ulp_off(gates_run, backend):
    """One element of the actor's copy of a tensor one bf16 ulp off before calibration (a converter that got
    it wrong) is refused bit for bit, whatever the floors: a 100-ulp fault moves the tiny model's mean gap
    to ~0.11, below the bf16 calibration cap, so no tolerance could be what stops it."""
    message = gates_run[backend]["converter_fault"]
    assert message is not None and "the engine's own load of model.path vs the trainer's conversion" in message
    assert "model.layers.1.mlp.down_proj.weight" in message


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_a_mangled_tensor_fails_the_bf16_probe(gates_run, backend):
    r = gates_run[backend]
    message = r["corrupted"]["message"]
    assert message is not None and message.startswith("weight sync verification failed (probe forward)")
    assert "(gates.probe_mean)" in message
    assert r["after_corruption"]["weight_sync/probe_mean_abs_diff"] <= BF16.probe_mean  # a clean sync repairs
