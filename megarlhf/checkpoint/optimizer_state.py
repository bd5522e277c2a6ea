"""Saving and loading Megatron optimizer state, around four loading bugs of the DistributedOptimizer with
torch's own Adam (always the case without Transformer Engine or apex) in megatron-core 0.19.2:

1. a never-stepped optimizer cannot build its loading state dict (``len(steps) == 1`` assertion): its
   state is primed first by one step at lr 0 (parameters unchanged), and a checkpoint saved that way is
   marked ``fresh`` so that loading it empties the state again;
2. the per-parameter 'step' is wrong after loading the parameter state: ``fully_reshardable`` loading
   raises ``KeyError: 'step'`` (its tensors lack it), and ``dp_reshardable`` loading copies in the loading
   template's own placeholder (the primed optimizer's step, 1) over the saved step. The step travels in the
   parameter groups (loaded first), so the per-parameter setter is told to leave it alone;
3. with fp32 parameters the main parameter is a view of a leaf that requires grad, so its in-place copy
   raises outside ``no_grad``: loading runs under ``torch.no_grad()``;
4. after loading, every parameter's 'step' is the same tensor, which Adam advances once per parameter per
   step (wrong bias correction): each parameter gets its own copy.

The DistributedOptimizer's state is saved in one of two Megatron formats (``checkpoint.optimizer_format``):

* ``dp_reshardable`` (the default, as Megatron-LM's): each data-parallel rank writes its own shard of the
  state in Megatron's per-bucket layout, in parallel, with no communication; it resumes at the same
  tensor/pipeline layout and any data-parallel size. On the SmolLM2 recipe at DP2 on CPU the final save
  took 3.7 s instead of 13-17.5 s, and rank 0 holds no gathered copy of the whole optimizer (+4 GB there).
* ``fully_reshardable``: the state is gathered onto data-parallel rank 0 (memory-efficiently: over gloo onto
  that rank alone, not all-gathered onto every rank) in the model's own layout; it resumes at any
  tensor/pipeline/data-parallel layout. Checkpoints written before the choice existed are in this format.

A resume may change the optimizer's hyperparameters (learning rate and its schedule, betas, weight decay):
the saved parameter groups take the running optimizer's values before they are loaded (the saved moments
and step counts stay). Without that, Megatron's optimizers, which find the saved groups by their
``max_lr``/``min_lr``/..., stop with a bare ``KeyError`` (distributed) or ``ValueError`` (plain); the lr
scheduler then follows the run's settings from the checkpoint's step count (``learner.models``).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from megarlhf.core.errors import CheckpointError

# checkpoint.optimizer_format -> the metadata that makes Megatron's DistributedOptimizer use that format
SHARDING_METADATA = {
    "dp_reshardable": {"distrib_optim_sharding_type": "dp_reshardable"},
    "fully_reshardable": {"distrib_optim_sharding_type": "fully_reshardable",
                          "distrib_optim_fully_reshardable_mem_efficient": True},
}
SAVED_BEFORE_FORMATS = "fully_reshardable"  # the format of checkpoints whose marker names none


def sharding_metadata(optimizer_format: str) -> dict:
    """Megatron's metadata for ``optimizer_format`` (a fresh dict: Megatron may add to it)."""
    if optimizer_format not in SHARDING_METADATA:
        raise CheckpointError(f"optimizer format {optimizer_format!r} is not one of {sorted(SHARDING_METADATA)}")
    return dict(SHARDING_METADATA[optimizer_format])


def inner_optimizers(optimizer) -> list:
    """The Megatron optimizers inside ``optimizer`` (a ChainedOptimizer holds one per parameter group set)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(megatron_optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(megatron_optimizer, DistributedOptimizer)


def is_fresh(optimizer) -> bool:
    """True when no inner optimizer holds state yet (no step was taken)."""
    return all(len(inner.optimizer.state) == 0 for inner in inner_optimizers(optimizer))


def prime(optimizer) -> None:
    """Gives a never-stepped DistributedOptimizer its state (bug 1): one step with zero gradients at lr 0
    (Megatron's own initialiser), which leaves the parameters exactly as they are."""
    for inner in inner_optimizers(optimizer):
        if not is_distributed(inner) or len(inner.optimizer.state):
            continue
        groups = inner.optimizer.param_groups
        saved_lr = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = 0.0
        try:
            inner._init_optimizer_states_with_dummy_values()
        finally:
            for group, lr in zip(groups, saved_lr):
                group["lr"] = lr


def clear_state(optimizer) -> None:
    for inner in inner_optimizers(optimizer):
        inner.optimizer.state.clear()


def optimizer_kind(optimizer) -> str:
    return "distributed" if any(is_distributed(inner) for inner in inner_optimizers(optimizer)) else "plain"


@contextmanager
def _step_not_in_loaded_tensors(inner):
    """Bug 2: ``_set_main_param_and_optimizer_states`` copies every state tensor of the live optimizer,
    'step' included, but the fully_reshardable loader leaves 'step' out of the loaded tensors and the
    dp_reshardable one passes the loading template's placeholder (the step travels in the param groups).
    Marking it absent (None is skipped by the setter) keeps the step the param groups restored."""
    original = inner._set_main_param_and_optimizer_states
    inner._set_main_param_and_optimizer_states = lambda param, tensors: original(param, {**tensors, "step": None})
    try:
        yield
    finally:
        del inner._set_main_param_and_optimizer_states


def _own_step_tensors(inner) -> None:
    """Bug 4: Megatron gives every parameter the same 'step' tensor, which torch's Adam advances once per
    parameter per step; each parameter gets its own copy."""
    for state in inner.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _take_current_hyperparameters(inner, state: dict) -> None:
    """The saved parameter groups of ``state`` get ``inner``'s running hyperparameters (all but the
    parameters, the step count and the learning rate, which the scheduler sets), group by group."""
    saved = (state["optimizer"] if "optimizer" in state else state)["param_groups"]
    live = inner.optimizer.param_groups
    if len(saved) != len(live):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this run's has "
                              f"{len(live)}: the trained parameters or their optimizer settings changed "
                              "(model.lora, freezing, per-group options) and cannot be resumed")
    for saved_group, live_group in zip(saved, live):
        saved_group.update({key: value for key, value in live_group.items() if key not in ("params", "step", "lr")})


def load_optimizer(optimizer, loaded) -> None:
    inners = inner_optimizers(optimizer)
    states = [loaded] if len(inners) == 1 else [state for _, state in sorted(loaded.items())]
    for inner, state in zip(inners, states):
        _take_current_hyperparameters(inner, state)
        if not is_distributed(inner):
            inner.load_state_dict(state)
            _own_step_tensors(inner)
            continue
        param_state = state.pop("param_state", None)
        sharding = state.pop("param_state_sharding_type", None)
        inner.load_state_dict(state)  # param groups (lr, betas, step) without the parameter state
        _own_step_tensors(inner)
        if param_state is None:
            continue
        loaders = {"fully_reshardable": inner.load_parameter_state_from_fully_reshardable,
                   "dp_reshardable": inner.load_parameter_state_from_dp_reshardable}
        if sharding not in loaders:
            raise CheckpointError(f"optimizer state in sharding format {sharding!r}; megarlhf reads "
                                  f"{sorted(loaders)}")
        with torch.no_grad(), _step_not_in_loaded_tensors(inner):  # bug 3 (see the module docstring), bug 2
            loaders[sharding](param_state)
    if len(inners) > 1:
        optimizer._synchronize_steps()
        for inner in inners:
            _own_step_tensors(inner)
