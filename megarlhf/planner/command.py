"""``megarlhf plan RECIPE [overrides]``: the dry run of a recipe on a given number of GPUs.

Builds the full RunConfig (the same loader as ``megarlhf train``), the parallel layout and the memory
plan without touching a GPU or the checkpoint, prints per-rank bytes per component and per phase, and
exits 0 when the plan fits; otherwise it names what does not fit, prints the smallest changes that do
(as overrides to paste) and exits 1. ``--json`` prints the plan as one JSON object instead.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from megarlhf.planner.memory import COMMANDS, GIB, PHASES, Launch, MemoryPlan, plan_memory
from megarlhf.planner.shapes import resolve_shape
from megarlhf.planner.suggest import suggest

ROWS = [("actor_weights", "actor weights"), ("actor_grads", "actor gradients (fp32)"),
        ("actor_optimizer", "actor optimizer state"), ("reference_weights", "reference weights"),
        ("teacher_weights", "teacher weights"),
        ("teacher_scores", "teacher scores"),
        ("critic_weights", "critic weights"), ("critic_grads", "critic gradients (fp32)"),
        ("critic_optimizer", "critic optimizer state"), ("reward_model_weights", "reward model weights"),
        ("activations", "activations"),
        ("engine_weights", "vLLM weights"), ("engine_kv_cache", "vLLM KV cache"),
        ("engine_sync_bucket", "weight-sync bucket"), ("judge_weights", "judge weights"),
        ("judge_kv_cache", "judge KV cache")]


def smallest_world(parallel, *others) -> int:
    """The fewest ranks ``parallel`` (and each layout of ``others``: a teacher's own) runs on: a multiple of both
    TP x PP x CP (one model copy) and TP x EP x PP (one copy of the experts) of each."""
    layouts = [parallel, *(other for other in others if other is not None)]
    return math.lcm(*(size for layout in layouts for size in (layout.model_parallel_size, layout.expert_layout_size)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (a RunConfig; see examples/recipes)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. parallel.tensor_model_parallel_size=2")
    parser.add_argument("--gpus", type=int, default=None, help="ranks in the job (default: the smallest the layout takes: TP x PP x CP, i.e. DP=1, "
                        "or more where expert parallelism needs it)")
    parser.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory of one device (default 80)")
    parser.add_argument("--reserve-gib", type=float, default=None,
                        help="per-rank memory set aside for runtime (CUDA context, NCCL, allocator, vLLM "
                             "workspace); default 3 on gpu, 0 on cpu")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="vLLM sleeps on gpu only")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="largest TP a suggestion may use (default 8)")
    parser.add_argument("--arch", default=None,
                        help="model shape: a preset name or a config.json (default: model.path's config.json, "
                             "or the preset named like model.path)")
    parser.add_argument("--command", choices=COMMANDS, default="train", dest="planned_command",
                        help="the megarlhf command that runs the recipe (which models it keeps; default train)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_from_args(args: argparse.Namespace):
    from megarlhf.config import RunConfig, load_config
    from megarlhf.run.checks import check_config

    config = load_config(RunConfig, args.recipe, args.overrides)
    check_config(config)
    shape, source = resolve_shape(config.model.path, args.arch)
    reserve = args.reserve_gib if args.reserve_gib is not None else (3.0 if args.device == "gpu" else 0.0)
    teacher_layout = config.teacher.parallel if config.teacher is not None else None
    launch = Launch(world_size=args.gpus or smallest_world(config.parallel, teacher_layout), device_memory_gib=args.gpu_mem_gib,
                    device=args.device, reserve_gib=reserve, command=args.planned_command)
    return config, shape, source, launch, plan_memory(config, shape, launch)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:8.2f}"


def format_plan(plan: MemoryPlan, source: str, config) -> str:
    par, s = config.parallel, plan.shape
    lines = [f"model      {s.name}: {s.total_params() / 1e9:.2f} B parameters, {s.num_layers} layers, hidden "
             f"{s.hidden_size}, {s.num_heads} heads / {s.num_kv_heads} KV heads (from {source})",
             f"layout     {plan.launch.world_size} ranks = TP {par.tensor_model_parallel_size} x PP "
             f"{par.pipeline_model_parallel_size} x CP {par.context_parallel_size} x DP {plan.data_parallel_size}; "
             f"{config.model.dtype}; distributed optimizer {'on' if config.optim.use_distributed_optimizer else 'off'}; "
             f"vLLM TP {config.rollout.tensor_parallel_size}",
             f"device     {plan.launch.device}, {plan.launch.device_memory_gib:g} GiB per rank, "
             f"{plan.launch.reserve_gib:g} GiB reserved -> {plan.capacity / GIB:.2f} GiB to plan with",
             "", "GiB per rank" + "".join(f"   stage {st.stage:<3d}" for st in plan.stages)]
    for key, label in ROWS:
        if any(st.components[key] for st in plan.stages):
            lines.append(f"  {label:<28s}" + "".join(f"  {_gib(st.components[key])}  " for st in plan.stages))
    if config.train.recompute.granularity == "none":
        lines.append(f"  {'activations (full recompute)':<28s}"
                     + "".join(f"  {_gib(st.activations_recompute)}  " for st in plan.stages))
    lines.append("phases (colocate schedule)")
    for phase in PHASES:
        if phase == "judge" and not any(st.phases[phase] for st in plan.stages):
            continue
        lines.append(f"  {phase:<28s}" + "".join(f"  {_gib(st.phases[phase])}  " for st in plan.stages))
    lines.append(f"  {'peak':<28s}" + "".join(f"  {_gib(st.peak)}  " for st in plan.stages))
    if not plan.sequences_per_engine:
        lines.append(f"engine     none (megarlhf {plan.launch.command}); sequences of up to "
                     f"{plan.max_model_len} tokens")
    else:
        lines.append(f"KV cache   {plan.kv_tokens} tokens = {plan.kv_tokens // plan.max_model_len} sequences of "
                     f"max_model_len {plan.max_model_len}; {plan.sequences_per_engine} sequences per engine per step")
    if plan.host_offload:
        lines.append(f"host       {plan.host_offload / GIB:.2f} GiB per rank offloaded (pinned) during generation")
    lines += [f"note       {n}" for n in plan.notes]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    config, shape, source, launch, plan = plan_from_args(args)
    changes = [] if plan.fits else suggest(config, shape, launch, gpus_per_node=args.gpus_per_node)
    if args.json:
        print(json.dumps({"fits": plan.fits, "problems": plan.problems(), "peak_bytes": plan.peak,
                          "capacity_bytes": plan.capacity, "kv_tokens": plan.kv_tokens,
                          "stages": [{"stage": st.stage, **st.components, "phases": st.phases,
                                      "activations_recompute": st.activations_recompute} for st in plan.stages],
                          "suggestions": [c.describe() for c, _ in changes]}))
        return 0 if plan.fits else 1
    print(format_plan(plan, source, config))
    if plan.fits:
        print(f"\nfits: peak {plan.peak / GIB:.2f} GiB of {plan.capacity / GIB:.2f} GiB per rank")
        return 0
    print("\nDOES NOT FIT: " + "; ".join(plan.problems()), file=sys.stdout)
    if changes:
        print("smallest changes that fit:")
        for change, new_plan in changes:
            print(f"  {change.describe()}    -> peak {new_plan.peak / GIB:.2f} GiB")
    else:
        print("no change of up to three steps (distributed optimizer, TP/PP x2, micro-batch, KV cache, GPUs x2, "
              "no reference) fits")
    return 1
