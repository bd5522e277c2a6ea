"""Whether a training checkpoint's optimizer state, schedulers and companion models fit the run that
resumes from it, checked before Megatron reads anything (its own errors name neither the checkpoint nor
the setting to change), and the layout a checkpoint records (``saved_with`` in its marker)."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megarlhf.checkpoint.optimizer_state import optimizer_kind
from megarlhf.core.errors import CheckpointError

MODEL_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size")


def current_layout() -> dict:
    """This job's world size and, once Megatron's groups exist, its parallel sizes."""
    from parallel.runtime import model_groups

    layout, groups = {"world_size": dist.get_world_size()}, model_groups()
    if groups.initialized:
        layout.update(tensor_model_parallel_size=groups.tp.size, pipeline_model_parallel_size=groups.pp.size,
                      data_parallel_size=groups.dp.size, expert_model_parallel_size=groups.ep.size)
    return layout


def _optimizer_kind_problems(name: str, saved: dict | None, optimizer) -> list[str]:
    """A distributed optimizer's state does not load into a plain one, nor the other way round."""
    if optimizer is None or not saved or "kind" not in saved or saved["kind"] == optimizer_kind(optimizer):
        return []
    distributed = saved["kind"] == "distributed"
    return [f"its optimizer state for {name} is {saved['kind']} and this run's optimizer is not: resume with "
            f"optim.use_distributed_optimizer={str(distributed).lower()}"]


def _optimizer_layout_problems(name: str, saved: dict | None, optimizer, saved_with: dict) -> list[str]:
    """A distributed optimizer saved in the ``dp_reshardable`` format holds its state in Megatron's
    per-bucket layout, which only another data-parallel size can read (checkpoint.optimizer_format)."""
    if optimizer is None or not saved or saved.get("kind") != "distributed":
        return []
    if saved.get("format", "fully_reshardable") != "dp_reshardable":
        return []
    layout = current_layout()
    changed = {key: (saved_with[key], layout[key]) for key in MODEL_PARALLEL_SIZES
               if key in saved_with and key in layout and saved_with[key] != layout[key]}
    if not changed:
        return []
    was = ", ".join(f"{key}={old}" for key, (old, _) in changed.items())
    now = ", ".join(f"{key}={new}" for key, (_, new) in changed.items())
    return [f"its optimizer state for {name} was saved with checkpoint.optimizer_format=dp_reshardable at {was} "
            f"(this run: {now}), which resumes at that tensor and pipeline layout only (any data-parallel size): "
            f"resume at {was}, or save the run with checkpoint.optimizer_format=fully_reshardable to change them "
            f"(weights alone load at any layout, e.g. megarlhf convert megatron-to-hf)"]


def check_parts_match(info: dict, path: Path, optimizer, scheduler, companions: dict) -> None:
    """Every optimizer, scheduler and companion asked for must be in the checkpoint (and the other way
    round for companions: a checkpoint of actor + critic does not resume an actor-only run), and each
    optimizer's state must load at this run's layout."""
    problems = []
    if optimizer is not None and not info.get("optimizer"):
        problems.append("it holds no optimizer state for the model")
    if scheduler is not None and not info.get("scheduler"):
        problems.append("it holds no lr scheduler state for the model")
    saved_with = info.get("saved_with", {})
    problems += _optimizer_kind_problems("the model", info.get("optimizer"), optimizer)
    problems += _optimizer_layout_problems("the model", info.get("optimizer"), optimizer, saved_with)
    saved = info.get("companions", {})
    if set(saved) != set(companions):
        problems.append(f"it holds the companion models {sorted(saved)}, this run has {sorted(companions)}")
    for name in set(saved) & set(companions):
        part = companions[name]
        if part.optimizer is not None and not saved[name].get("optimizer"):
            problems.append(f"it holds no optimizer state for {name!r}")
        if part.scheduler is not None and not saved[name].get("scheduler"):
            problems.append(f"it holds no lr scheduler state for {name!r}")
        problems += _optimizer_kind_problems(repr(name), saved[name].get("optimizer"), part.optimizer)
        problems += _optimizer_layout_problems(repr(name), saved[name].get("optimizer"), part.optimizer, saved_with)
    problems += _expert_layout_problems(info, optimizer, companions)
    if problems:
        raise CheckpointError(f"checkpoint at {path} does not fit this run: {'; '.join(problems)}")


def _expert_layout_problems(info: dict, optimizer, companions: dict) -> list[str]:
    wants_optimizer = optimizer is not None or any(part.optimizer is not None for part in companions.values())
    saved_ep = info.get("saved_with", {}).get("expert_model_parallel_size")  # None: not recorded (older saves)
    ep = current_layout().get("expert_model_parallel_size", 1)
    if not wants_optimizer or saved_ep is None or saved_ep == ep:
        return []
    # Megatron gives the experts an optimizer of their own when EP > 1 (a chained optimizer, whose state
    # is saved under other keys), so optimizer state does not carry over to another EP size
    return [f"it was saved at expert_model_parallel_size={saved_ep}, this run has {ep}, and an MoE "
            f"model's optimizer state is laid out per expert-parallel size: resume at "
            f"expert_model_parallel_size={saved_ep}, or start a new run from the checkpoint's weights "
            f"(weights alone load at any layout, e.g. megarlhf convert megatron-to-hf)"]
