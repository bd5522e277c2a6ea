"""Rank script of tests/run/test_checkpointer.py.

Usage: _worker_run_checkpoint.py MODE OUT_DIR MODEL_DIR CRITIC_DIR WORK_DIR [DP2_WORK_DIR KILL_DIR]

MODE "dp2" (2 ranks) and "single" (1 rank): resume equivalence of the training engine (dp2 and the
single-rank plain-optimizer run save with checkpoint.async_save, their writes held until steps 3-4 ran). The reference
run takes 4 RL steps (actor_update + critic_update, 2 optimizer steps each, warmup + cosine lr, weight
decay, clipping) on fixed synthetic experience; the interrupted run takes 2, saves through
RunCheckpointer, then actor and critic are rebuilt from the HF directories, the RNGs re-seeded
elsewhere, the checkpoint resumed, and 2 more steps taken. Records both runs' metrics and whether
parameters, Adam state (exp_avg, exp_avg_sq, step) and lr are bit-identical. Each rank perturbs its RNG
streams differently first and draws from every stream in every step, so per-rank RNG restoration shows.
"single" also: the plain optimizer variant, resuming the dp2 checkpoint at DP=1, pruning and resume
selection, error messages, a checkpoint of never-stepped optimizers, and resuming after the kill.

MODE "kill" (plain process): saves step_1, then dies (os._exit) while writing step_2's completion marker.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel, seed_everything

PROMPT_LENGTHS = (5, 3, 7, 4, 2, 6, 3, 5)
RESPONSE_LENGTHS = (9, 12, 4, 14, 7, 3, 11, 6)
VOCAB = 384
STEPS, SAVE_AT = 4, 2

RUNTIME = None  # set by main: the Runtime init_parallel returned
HOLD = None  # set by main: while this file exists, background checkpoint writes wait (hold_background_writes)


def make_config(model_dir: str, critic_dir: str, ckpt_dir: Path, distributed: bool = True, **checkpoint):
    from megarlhf.config.train import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig
    from megarlhf.config.model import ModelConfig
    from megarlhf.config.schema import RunConfig
    from megarlhf.config.data import DataConfig

    config = RunConfig(
        model=ModelConfig(path=model_dir, dtype="float32", critic_path=critic_dir),
        data=DataConfig(train_path="unused.jsonl"),
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, schedule="cosine", weight_decay=0.01,
                          clip_grad=1.0, critic_lr=2e-3, use_distributed_optimizer=distributed),
        train=TrainConfig(steps=STEPS, global_batch_size=8, mini_batches=2, micro_batch_tokens=40),
        checkpoint=CheckpointConfig(**{"dir": str(ckpt_dir), "every": SAVE_AT, "keep_last": 2, **checkpoint}),
        logging=LoggingConfig(run_dir=str(ckpt_dir.parent / "run")))
    config.algorithm.entropy_coef = 0.01
    config.algorithm.kl.coef = 0.05
    return config


def global_batch(step: int):
    """The step's global experience batch (GRPO advantages from the registry) and fixed noise [B, L]."""
    from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs
    from megarlhf.config.algorithm import AdvantageConfig
    from megarlhf.learner import ExperienceBatch

    g = torch.Generator().manual_seed(step)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    responses = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in RESPONSE_LENGTHS]
    batch = ExperienceBatch.from_sequences(prompts, responses, device=torch.device("cpu"),
                                           group_ids=[i // 2 for i in range(8)])
    rewards = torch.rand(8, generator=g)
    out = ADVANTAGE_ESTIMATORS.get("grpo")(
        AdvantageInputs(rewards=rewards, response_mask=batch.response_mask, group_ids=batch.group_ids),
        AdvantageConfig())
    noise = torch.randn(3, *batch.input_ids.shape, generator=g)
    return batch.replace(advantages=out.advantages.float(), returns=out.returns.float()), noise


def rl_step(models: dict, config, step: int) -> dict:
    """One RL step on this DP rank's share of the step's batch; metrics plus one draw from each RNG."""
    from megatron.core import tensor_parallel

    from megarlhf.learner import actor_update, compute_logprobs, compute_values, critic_update

    batch, noise = global_batch(step)
    dp = RUNTIME.dp
    rows = torch.arange(batch.batch_size)[dp.rank::dp.size]
    local = batch.select(rows)
    noise = noise[:, rows, :local.input_ids.shape[1]]
    actor, critic = models["actor"], models.get("critic")
    lp = compute_logprobs(actor, local, config)
    local = local.replace(old_logprobs=lp + 0.05 * noise[0], ref_logprobs=lp + 0.2 * noise[1])
    metrics = actor_update(actor, local, config)
    if critic is not None:
        values = compute_values(critic, local, config)
        metrics.update(critic_update(critic, local.replace(values=values + 0.3 * noise[2]), config))
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker_draw = torch.rand(1).item()
    metrics["rng"] = [random.random(), float(np.random.rand()), torch.rand(1).item(), tracker_draw]
    return metrics


def build(config) -> dict:
    from megarlhf.learner import build_actor, build_critic

    return {"actor": build_actor(config, RUNTIME), "critic": build_critic(config, RUNTIME)}


def snapshot(models: dict) -> dict:
    """Parameters, Adam state tensors (per parameter, optimizer order) and lr per group, cloned."""
    out = {}
    for role, m in models.items():
        out[f"{role}/params"] = [p.detach().clone() for p in m.model.parameters()]
        states = {"exp_avg": [], "exp_avg_sq": [], "step": []}
        lrs = []
        for inner in m.optimizer.chained_optimizers:
            for group in inner.optimizer.param_groups:
                lrs.append(group["lr"])
                for p in group["params"]:
                    for key in states:
                        states[key].append(inner.optimizer.state[p][key].detach().clone())
        out.update({f"{role}/{key}": v for key, v in states.items()})
        out[f"{role}/lr"] = lrs
        out[f"{role}/scheduler_steps"] = m.scheduler.num_steps
    return out


def compare(a: dict, b: dict) -> dict:
    """Per entry: bit-identical? (tensor lists: every tensor; plain values: ==)."""
    result = {}
    for key in a:
        if isinstance(a[key], list) and a[key] and torch.is_tensor(a[key][0]):
            result[key] = len(a[key]) == len(b[key]) and all(torch.equal(x, y) for x, y in zip(a[key], b[key]))
        else:
            result[key] = a[key] == b[key]
    return result


def perturb_rng_per_rank() -> None:
    """DP replicas share RNG streams after seeding; move each rank's streams by a different amount."""
    for _ in range(dist.get_rank() + 1):
        random.random(), np.random.rand(), torch.rand(1)


def equivalence(config_fn, label: str) -> dict:
    """Uninterrupted 4 steps vs 2 + save + rebuild + resume + 2 (see the module docstring). With
    ``checkpoint.async_save`` the interrupted run also takes steps 3 and 4 while its save is written."""
    from megarlhf.checkpoint.distributed import is_complete_checkpoint
    from megarlhf.run.checkpointer import RunCheckpointer

    seed_everything(1234)
    perturb_rng_per_rank()
    config = config_fn()
    models = build(config)
    reference = [rl_step(models, config, step) for step in range(1, STEPS + 1)]
    final = snapshot(models)
    del models

    seed_everything(1234)
    perturb_rng_per_rank()
    models = build(config)
    first = [rl_step(models, config, step) for step in range(1, SAVE_AT + 1)]
    checkpointer = RunCheckpointer(config, models)
    if config.checkpoint.async_save:
        HOLD.touch()
    path = checkpointer.save(SAVE_AT, {"step": SAVE_AT, "label": label})
    saved = snapshot(models)
    in_flight = {}
    if config.checkpoint.async_save:  # train on while the save is held: the files must hold step SAVE_AT
        in_flight["published_at_save"] = is_complete_checkpoint(path)
        for step in range(SAVE_AT + 1, STEPS + 1):
            checkpointer.poll()
            in_flight.setdefault("steps", []).append(rl_step(models, config, step))
        in_flight["pending_after_steps"] = [p.name for p in checkpointer.writer.pending]
        HOLD.unlink()
        checkpointer.close()
        in_flight["published_at_close"] = is_complete_checkpoint(path)
        in_flight["listing"] = listing(path.parent)
    del models, checkpointer

    seed_everything(999)  # the "new process" starts from other streams: resume must restore them
    config = config_fn()
    models = build(config)
    fresh = [p.detach().clone() for p in models["actor"].model.parameters()]
    extra = RunCheckpointer(config, models).resume()
    at_resume = compare(saved, snapshot(models))
    second = [rl_step(models, config, step) for step in range(SAVE_AT + 1, STEPS + 1)]
    return {
        "reference": reference, "resumed": first + second, "extra_state": extra, "path": str(path),
        "fresh_differs": not compare({"p": saved["actor/params"]}, {"p": fresh})["p"],
        "equal_at_resume": at_resume, "equal_at_end": compare(final, snapshot(models)),
        "in_flight": in_flight,
        "adam_steps": {"saved": float(saved["actor/step"][0]), "final": [float(t) for t in final["actor/step"]]},
        "lr": {"saved": saved["actor/lr"], "final": final["actor/lr"]},
        "_final_actor": final["actor/params"],
    }


def hold_background_writes(hold: Path) -> None:
    """While the file ``hold`` exists, Megatron's background writer waits before writing (a synchronous save,
    which writes in this process, never meets a hold: it is created only around async saves)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data_multithread

    def held_write(*args, **kwargs):
        deadline = time.time() + 300
        while hold.exists() and time.time() < deadline:
            time.sleep(0.05)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(held_write)


def publish_failure(model_dir: str, critic_dir: str, work: Path) -> dict:
    """Rank 0 cannot write the completion marker (a full disk): every rank gets an error, none waits."""
    from megarlhf.checkpoint import publish
    from megarlhf.run.checkpointer import RunCheckpointer

    config = make_config(model_dir, critic_dir, work / "publish_failure")
    models = actor_only(config)
    original = publish.write_json_durably
    if dist.get_rank() == 0:
        def full_disk(path, payload):
            raise OSError(28, "No space left on device")

        publish.write_json_durably = full_disk
    try:
        error = error_of(lambda: RunCheckpointer(config, models).save(1, {"step": 1}))
    finally:
        publish.write_json_durably = original
    return {"error": error, "listing": listing(work / "publish_failure")}


def dp2_mode(model_dir: str, critic_dir: str, work: Path) -> dict:
    """Equivalence at DP=2 (saving in the background), then the uninterrupted run's final actor weights for
    the DP=1 resume check."""
    result = equivalence(lambda: make_config(model_dir, critic_dir, work / "checkpoints", async_save=True), "dp2")
    final = result.pop("_final_actor")
    if dist.get_rank() == 0:
        torch.save(final, work / "final_actor.pt")
    return result


def reshard_check(model_dir: str, critic_dir: str, dp2_work: Path, work: Path) -> dict:
    """Resume the DP=2 checkpoint (step 2) at DP=1 and take steps 3 and 4 on the same global batches."""
    from megarlhf.checkpoint.distributed import CheckpointError, load_rank_state
    from megarlhf.run.checkpointer import RunCheckpointer

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("megarlhf.run.checkpointer").addHandler(handler)
    config = make_config(model_dir, critic_dir, work / "reshard", resume=str(dp2_work / "checkpoints" / "step_2"))
    models = build(config)
    extra = RunCheckpointer(config, models).resume()
    warnings = list(records)
    state = snapshot(models)
    steps = [rl_step(models, config, step) for step in range(SAVE_AT + 1, STEPS + 1)]
    final = snapshot(models)
    # Controls: the same resume with Adam's state dropped after loading (what losing it would do), and
    # the DP=1 run that was never interrupted (the DP=1 vs DP=2 rounding difference).
    config.checkpoint.dir = str(work / "reshard_control")
    lost = build(config)
    RunCheckpointer(config, lost).resume()
    for inner in lost["actor"].optimizer.chained_optimizers:
        inner.optimizer.state.clear()
    for step in range(SAVE_AT + 1, STEPS + 1):
        rl_step(lost, config, step)
    dp2_final = torch.load(dp2_work / "final_actor.pt")
    dp1_final = torch.load(work / "final_actor_dp1.pt")
    try:
        load_rank_state(dp2_work / "checkpoints" / "step_2")
        rank_state_error = None
    except CheckpointError as err:
        rank_state_error = str(err)

    def diff(params):
        return max(float((a - b).abs().max()) for a, b in zip(params, dp2_final))

    return {"extra_state": extra, "warnings": warnings, "metrics": steps, "rank_state_error": rank_state_error,
            "final_param_max_diff": diff(final["actor/params"]), "dp1_vs_dp2_max_diff": diff(dp1_final),
            "lost_optimizer_max_diff": diff(snapshot(lost)["actor/params"]),
            "adam_step_at_resume": float(state["actor/step"][0]), "lr_at_resume": state["actor/lr"],
            "scheduler_steps_at_resume": state["actor/scheduler_steps"]}


def actor_only(config) -> dict:
    from megarlhf.learner import build_actor

    return {"actor": build_actor(config, RUNTIME)}


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


def selection_checks(model_dir: str, critic_dir: str, work: Path, with_critic_ckpt: str) -> dict:
    """Never-stepped optimizer round trip, keep_last pruning, resume selection and its errors."""
    from megarlhf.run.checkpointer import RunCheckpointer

    out = {}
    ckpt = work / "select"
    config = make_config(model_dir, critic_dir, ckpt, every=1, keep_last=2)
    models = actor_only(config)
    checkpointer = RunCheckpointer(config, models)
    out["resume_without_checkpoints"] = checkpointer.resume()
    checkpointer.save(0, {"step": 0})  # before the first optimizer step
    rl_step(models, config, 1)
    after_first = snapshot(models)
    models = actor_only(config)
    config.checkpoint.resume = str(ckpt / "step_0")
    out["fresh_extra"] = RunCheckpointer(config, models).resume()
    out["fresh_state_empty"] = all(len(i.optimizer.state) == 0 for i in models["actor"].optimizer.chained_optimizers)
    rl_step(models, config, 1)
    out["fresh_then_step_equal"] = compare(after_first, snapshot(models))
    checkpointer = RunCheckpointer(config, models)
    for step in (1, 2, 3):
        checkpointer.save(step, {"step": step})
        out[f"listing_after_{step}"] = listing(ckpt)
    shutil.copytree(ckpt / "step_3", ckpt / "step_7")
    (ckpt / "step_7" / "megarlhf_checkpoint.json").unlink()  # a save that never completed
    shutil.copytree(ckpt / "step_3", ckpt / "step_9.tmp-123-deadbeef")
    (ckpt / "step_9.tmp-123-deadbeef" / "megarlhf_checkpoint.json").unlink()  # a killed save
    config.checkpoint.resume = "auto"
    out["auto_extra"] = RunCheckpointer(config, actor_only(config)).resume()
    config.checkpoint.resume = "none"
    out["none_extra"] = RunCheckpointer(config, models).resume()
    errors = {}
    for name, path in (("incomplete", ckpt / "step_7"), ("missing", work / "nope"),
                       ("with_critic", Path(with_critic_ckpt))):
        config.checkpoint.resume = str(path)
        errors[name] = error_of(lambda: RunCheckpointer(config, models).resume())
    config.checkpoint.resume = str(ckpt / "step_3")
    errors["critic_missing"] = error_of(lambda: RunCheckpointer(config, build(config)).resume())
    out["errors"] = errors
    return out


def after_kill(model_dir: str, critic_dir: str, kill_dir: Path) -> dict:
    """The killed save left step_1 loadable; saving step_2 again clears the partial one."""
    from megarlhf.run.checkpointer import RunCheckpointer

    config = make_config(model_dir, critic_dir, kill_dir / "checkpoints", every=1, keep_last=3)
    models = actor_only(config)
    checkpointer = RunCheckpointer(config, models)
    extra = checkpointer.resume()
    saved = torch.load(kill_dir / "saved_actor.pt")
    equal = all(torch.equal(a, b) for a, b in zip(snapshot(models)["actor/params"], saved))
    rl_step(models, config, 2)
    checkpointer.save(2, {"step": 2})
    return {"extra_state": extra, "params_equal": equal, "listing_after_save": listing(kill_dir / "checkpoints")}


def async_failure(model_dir: str, critic_dir: str, work: Path) -> dict:
    """checkpoint.async_save: the next save publishes the one in flight first; a background write that
    fails (its directory removed under the writer) is reported and not published."""
    from megarlhf.run.checkpointer import RunCheckpointer

    config = make_config(model_dir, critic_dir, work / "async_failure", every=1, async_save=True)
    models = actor_only(config)
    checkpointer = RunCheckpointer(config, models)
    rl_step(models, config, 1)
    checkpointer.save(1, {"step": 1})
    rl_step(models, config, 2)
    HOLD.touch()
    path = checkpointer.save(2, {"step": 2})
    in_flight = listing(path.parent)
    for partial in path.parent.glob("step_2.tmp-*"):
        shutil.rmtree(partial)
    HOLD.unlink()
    return {"listing_in_flight": in_flight, "error": error_of(checkpointer.close), "listing_after": listing(path.parent),
            "latest": RunCheckpointer(config, models).latest().name}


def kill_mode(model_dir: str, critic_dir: str, work: Path) -> None:
    from megarlhf.checkpoint import publish
    from megarlhf.run.checkpointer import RunCheckpointer

    config = make_config(model_dir, critic_dir, work / "checkpoints", every=1, keep_last=3)
    models = actor_only(config)
    checkpointer = RunCheckpointer(config, models)
    rl_step(models, config, 1)
    checkpointer.save(1, {"step": 1})
    torch.save(snapshot(models)["actor/params"], work / "saved_actor.pt")

    def dying_write(path, payload):  # half a marker, then the process is gone
        with open(path, "w") as f:
            f.write(json.dumps(payload)[:40])
            f.flush()
        os._exit(17)

    publish.write_json_durably = dying_write
    rl_step(models, config, 2)
    checkpointer.save(2, {"step": 2})


def main() -> None:
    global RUNTIME, HOLD
    mode, out_dir, model_dir, critic_dir, work = sys.argv[1:6]
    work = Path(work)
    RUNTIME = init_parallel(ParallelConfig())
    HOLD = work / f"hold_writes_rank{dist.get_rank()}"
    hold_background_writes(HOLD)
    if mode == "kill":
        kill_mode(model_dir, critic_dir, work)
        return
    if mode == "dp2":
        write_rank_result(out_dir, dist.get_rank(), {"distributed": dp2_mode(model_dir, critic_dir, work),
                                                     "publish_failure": publish_failure(model_dir, critic_dir, work)})
        return
    dp2_work, kill_dir = Path(sys.argv[6]), Path(sys.argv[7])
    result, started = {}, time.perf_counter()
    for name, distributed, fmt in (("distributed", True, "dp_reshardable"),
                                   ("fully_reshardable", True, "fully_reshardable"), ("plain", False, None)):
        # the plain optimizer's Adam state is updated in place, not through views: the async save must still
        # hold the values of the moment it was made
        options = {"async_save": not distributed, **({"optimizer_format": fmt} if fmt else {})}
        result[name] = equivalence(lambda: make_config(model_dir, critic_dir, work / name, distributed, **options),
                                   name)
        final = result[name].pop("_final_actor")
        if distributed:
            torch.save(final, work / "final_actor_dp1.pt")
    result["seconds_equivalence"] = time.perf_counter() - started
    result["reshard"] = reshard_check(model_dir, critic_dir, dp2_work, work)
    result["selection"] = selection_checks(model_dir, critic_dir, work, result["distributed"]["path"])
    result["after_kill"] = after_kill(model_dir, critic_dir, kill_dir)
    result["async_failure"] = async_failure(model_dir, critic_dir, work)
    result["seconds_total"] = time.perf_counter() - started
    write_rank_result(out_dir, 0, result)


if __name__ == "__main__":  # torch_dist saves start a multiprocessing Manager: the guard is required
    main()
