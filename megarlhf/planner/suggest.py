"""The smallest change that makes a refused layout fit, found by re-planning candidate changes.

A :class:`Change` is a set of recipe overrides (``key=value``, applied through the config loader, so a
suggestion is exactly what the user would type) and possibly another world size. :func:`suggest`
searches breadth-first: every single change first, then pairs, then triples, each level in the order of
:func:`_moves`, which lists the cheapest changes first (a free switch before a slower step, more model
parallelism before more GPUs, an algorithm change last; activation recomputation trades train time
for memory). It returns the first few that fit.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from megarlhf.config import RunConfig, apply_override, from_dict, parse_override, to_dict
from megarlhf.core.dtypes import dtype_bytes
from megarlhf.planner.memory import MIB, Launch, MemoryPlan, plan_memory
from megarlhf.planner.shapes import ModelShape


@dataclass(frozen=True)
class Change:
    overrides: tuple[str, ...] = ()
    world_size: int | None = None  # another --gpus
    notes: tuple[str, ...] = ()  # what the change costs

    def then(self, other: "Change") -> "Change":
        """Both changes; a key set again keeps its later value."""
        merged = {o.split("=", 1)[0]: o for o in self.overrides + other.overrides}
        notes = self.notes + tuple(n for n in other.notes if n not in self.notes)
        return Change(tuple(merged.values()), other.world_size or self.world_size, notes)

    def describe(self) -> str:
        parts = list(self.overrides) + ([f"--gpus {self.world_size}"] if self.world_size else [])
        return " ".join(parts) + (f"  ({'; '.join(self.notes)})" if self.notes else "")


def apply_change(config: RunConfig, launch: Launch, change: Change) -> tuple[RunConfig, Launch]:
    tree = to_dict(config)
    for text in change.overrides:
        apply_override(tree, *parse_override(text))
    world = change.world_size or launch.world_size
    return from_dict(RunConfig, tree), replace(launch, world_size=world)


def _moves(config: RunConfig, shape: ModelShape, launch: Launch, plan: MemoryPlan,
           gpus_per_node: int) -> Iterator[Change]:
    """Single changes worth trying from here, cheapest first."""
    par, world = config.parallel, launch.world_size
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    if not config.optim.use_distributed_optimizer and plan.data_parallel_size * cp > 1:
        yield Change(("optim.use_distributed_optimizer=true",))
    if plan.kv_tokens < plan.max_model_len:
        need = -(-plan.max_model_len * shape.kv_elements_per_token() * dtype_bytes(config.model.dtype)
                 // config.rollout.tensor_parallel_size // MIB)
        yield Change((f"rollout.kv_cache_mb={need}",))
    else:
        spare = plan.capacity - max(s.phases["generate"] for s in plan.stages)
        if spare < 0 and config.rollout.kv_cache_mb * MIB + spare > 0:
            kv_mb = (config.rollout.kv_cache_mb * MIB + spare) // MIB
            yield Change((f"rollout.kv_cache_mb={kv_mb}",), notes=("fewer sequences in flight",))
    if config.train.recompute.granularity == "none":
        yield Change(("train.recompute.granularity=full",), notes=("recomputes activations: ~1/3 more train compute",))
    if config.train.micro_batch_tokens // 2 >= plan.max_model_len:
        yield Change((f"train.micro_batch_tokens={config.train.micro_batch_tokens // 2}",),
                     notes=("smaller micro-batches",))
    model_parallel = [("tensor_model_parallel_size", tp * 2, tp * 2 <= gpus_per_node and not shape.num_experts),
                      ("pipeline_model_parallel_size", pp * 2, True)]
    for key, value, allowed in model_parallel:
        new_tp, new_pp = (value, pp) if key.startswith("tensor") else (tp, value)
        if allowed and world % (new_tp * new_pp * cp) == 0 and _layout_ok(shape, new_tp, new_pp) \
                and config.train.global_batch_size % (world // (new_tp * new_pp * cp)) == 0:
            yield Change((f"parallel.{key}={value}",))
    ep = par.expert_model_parallel_size
    if shape.num_experts and shape.num_experts % (2 * ep) == 0 and world % (tp * 2 * ep * pp) == 0:
        yield Change((f"parallel.expert_model_parallel_size={2 * ep}",), notes=("experts split over more ranks",))
    if config.rollout.tensor_parallel_size == 1 and 1 < world <= gpus_per_node:
        yield Change((f"rollout.tensor_parallel_size={world}",), notes=("one engine over all ranks",))
    yield Change(world_size=world * 2, notes=("more GPUs",))
    if world * 2 < gpus_per_node:
        yield Change(world_size=gpus_per_node, notes=("more GPUs",))
    if config.algorithm.uses_reference:
        yield Change(("algorithm.kl_mode=none",), notes=("drops the reference model: no KL term",))


def _layout_ok(shape: ModelShape, tp: int, pp: int) -> bool:
    try:
        shape.check_layout(tp, pp)
    except ValueError:
        return False
    return True


def _try(config: RunConfig, launch: Launch, shape: ModelShape, change: Change) -> MemoryPlan | None:
    try:
        new_config, new_launch = apply_change(config, launch, change)
        return plan_memory(new_config, shape, new_launch)
    except ValueError:
        return None


def suggest(config: RunConfig, shape: ModelShape, launch: Launch, gpus_per_node: int = 8, limit: int = 3,
            max_depth: int = 3) -> list[tuple[Change, MemoryPlan]]:
    """Up to ``limit`` changes (fewest steps first) after which the plan fits; [] if none within
    ``max_depth`` steps."""
    frontier = [(Change(), plan_memory(config, shape, launch))]
    for _ in range(max_depth):
        found, next_frontier, seen = [], [], set()
        for base, base_plan in frontier:
            base_config, base_launch = apply_change(config, launch, base)
            for move in _moves(base_config, shape, base_launch, base_plan, gpus_per_node):
                change = base.then(move)
                key = (frozenset(change.overrides), change.world_size)
                if key in seen:
                    continue
                seen.add(key)
                plan = _try(config, launch, shape, change)
                if plan is None:
                    continue
                (found if plan.fits else next_frontier).append((change, plan))
        if found:
            return found[:limit]
        frontier = next_frontier[:24]  # the cheapest partial changes carry on
    return []

