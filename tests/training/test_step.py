"""The non-finite gate of the optimizer step (single-rank worker): a NaN advantage in skip mode leaves
every parameter, every optimizer-state tensor and the lr schedule unchanged and is counted; abort mode
raises naming the non-finite loss, gradients and (for an injected inf weight) the parameter."""
from __future__ import annotations

import math


def test_skip_leaves_state_unchanged_and_is_counted(single_run):
    r = single_run["gate"]
    assert r["state_tensors"] > 50  # parameters + Adam moments + steps
    assert r["skip_unchanged"] and r["skip_scheduler_unchanged"]
    assert r["skip_metrics"]["actor/skipped_steps"] == 1
    assert math.isnan(r["skip_metrics"]["actor/grad_norm"])


def test_abort_raises_naming_what_was_non_finite(single_run):
    r = single_run["gate"]
    loss = r["abort_loss_message"]
    assert loss and "actor update: the actor loss is non-finite (loss = nan)" in loss
    assert "no optimizer step was taken" in loss
    param = r["abort_param_message"]
    assert param and "parameters hold non-finite values on rank 0: decoder.final_layernorm.weight" in param
    assert r["abort_unchanged"]
