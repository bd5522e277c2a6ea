"""What the engines hold (megarlhf/rollout/sync/held.py) and the step-0 gate that measures the natural floor
itself (megarlhf/rollout/sync/calibration.py, ``step0_problems``), on small models in one process. The
runs that use both, at TP2, DP2 and disaggregated, are in tests/loops/test_rl.py; the fault-injected syncs
that must never be skipped in tests/rollout/test_weight_sync.py and test_bf16_gates.py."""
from types import SimpleNamespace

import pytest
import torch

from megarlhf.config import RunConfig, load_config
from megarlhf.rollout.sync.calibration import step0_problems
from megarlhf.rollout.sync.gates import CALIBRATION_CAPS, FLOORS, run_tolerances
from megarlhf.rollout.sync.held import HeldWeights
from megarlhf.rollout.sync.weights import WeightSyncError


class OneRank:
    """The runtime of a single trainer rank: its collectives return their input."""

    def all_reduce_on_device(self, tensor, op="sum", over="dp"):
        return tensor


def _held() -> tuple[HeldWeights, torch.nn.Module]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    return HeldWeights(model, OneRank()), model


def test_a_sync_is_skipped_only_while_no_parameter_changed_since_the_engines_were_proven_to_hold_it():
    held, model = _held()
    assert not held.unchanged(held.current()) and not held.own_load  # nothing known yet: a sync must send
    held.checkpoint_verified()
    assert held.unchanged(held.current()) and held.own_load
    with torch.no_grad():
        model[1].weight.view(-1)[5:6].view(torch.int32).add_(1)  # one ulp of one element
    prints = held.current()
    assert not held.unchanged(prints)
    held.forget()  # a sync began; were it to fail, the engines would hold anything
    assert not held.unchanged(prints) and not held.own_load
    held.synced(prints)
    assert held.unchanged(held.current()) and not held.own_load  # verified, but no longer the engines' own load
    with torch.no_grad():  # swapping two rows keeps every value: the fingerprint weighs positions
        model[0].weight[[0, 1]] = model[0].weight[[1, 0]].clone()
    assert not held.unchanged(held.current())


def _sync_like(dtype: str, natural_deferred: bool, own_load: bool, is_moe: bool = False):
    config = load_config(RunConfig, None, ["model.path=/m", f"model.dtype={dtype}"])
    floor = (2e-5, 4e-6)
    return SimpleNamespace(config=config, actor=SimpleNamespace(provider=SimpleNamespace(is_moe=is_moe)),
                           floor=floor, tolerances=run_tolerances(config, floor), natural_deferred=natural_deferred,
                           held=SimpleNamespace(own_load=own_load))


def test_step0_takes_the_natural_floor_when_the_engine_still_held_its_own_load():
    """bf16 numbers of SmolLM2's size: the gap of step 0 (0.9 max, 0.05 mean) is its natural floor and sets
    the step-0 tolerances (5x max, 3x mean), which the probe floor alone would have set below it."""
    sync = _sync_like("bfloat16", natural_deferred=True, own_load=True)
    calibration = {"gates/calibration_checkpoint_bitwise": 1.0}
    assert sync.tolerances.step0_problems(0.9, 0.05)  # what the probe's floor alone would refuse
    assert step0_problems(sync, calibration, 0.9, 0.05) == []
    assert sync.tolerances.step0_max == pytest.approx(4.5) and sync.tolerances.step0_mean == pytest.approx(0.15)
    assert calibration["gates/calibration_natural_max"] == 0.9 and calibration["gates/calibration_natural_mean"] == 0.05
    assert calibration["gates/step0_mean"] == pytest.approx(0.15) and not sync.natural_deferred


def test_step0_caps_the_natural_floor_as_calibration_does():
    """An engine that computes another function of the same weights (a mean gap above the dtype's cap on
    its own load) stops the run at step 0 with calibration's error, on every rank (the gap is global)."""
    sync = _sync_like("float32", natural_deferred=True, own_load=True)
    with pytest.raises(WeightSyncError, match=r"(?s)calibration before the first sync.*the natural samples is 0\.002 > "
                                              + str(CALIBRATION_CAPS["float32"])):
        step0_problems(sync, {}, 0.01, 0.002)
    moe = _sync_like("float32", natural_deferred=True, own_load=True, is_moe=True)
    with pytest.raises(WeightSyncError, match="routing_replay='r3' replays the engine's routing"):
        step0_problems(moe, {}, 0.5, 0.01)


def test_step0_is_judged_by_the_tolerances_once_anything_was_sent():
    """The natural floor was left to step 0 but a sync sent weights first (the engine no longer holds its own
    load): the gap is judged by the tolerances (the probe's floor, as without calibration prompts)."""
    sync = _sync_like("float32", natural_deferred=True, own_load=False)
    calibration = {}
    problems = step0_problems(sync, calibration, 5e-3, 1e-5)
    assert problems == [f"step-0 gate: max |trainer - engine| log-prob gap 0.005 > {FLOORS['float32'].step0_max:g} "
                        f"(gates.step0_max)"]
    assert calibration == {} and sync.natural_deferred
    measured = _sync_like("float32", natural_deferred=False, own_load=True)  # calibration measured it
    assert step0_problems(measured, calibration, 5e-4, 5e-5) == [] and calibration == {}


def test_a_sync_that_fails_leaves_the_engines_unknown_so_the_next_one_sends():
    """sync_unless_held, as both placements' syncs use it: back at the weights of the last verified sync after a
    failed one (which may have left the engines with anything), the next sync sends."""
    held, model = _held()
    held.checkpoint_verified()
    sent = []

    def send():
        sent.append(1)
        return {"weight_sync/tensors": 2.0}

    def fail():
        raise RuntimeError("the engine's fingerprints differ")

    first = held.sync_unless_held(send)
    assert first["weight_sync/skipped"] == 1.0 and first["time/weight_sync_s"] >= 0 and sent == []
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model[0].bias.add_(1.0)
    with pytest.raises(RuntimeError, match="fingerprints differ"):
        held.sync_unless_held(fail)
    with torch.no_grad():
        for param, value in zip(model.parameters(), before):
            param.copy_(value)
    assert held.sync_unless_held(send) == {"weight_sync/tensors": 2.0, "weight_sync/skipped": 0.0} and sent == [1]
    assert held.sync_unless_held(send)["weight_sync/skipped"] == 1.0 and sent == [1]
