"""The RL driver: GRPO, PPO with a GAE critic, DAPO, Dr.GRPO, RLOO, REINFORCE++, ReMax, GSPO, CISPO.

The algorithm is the recipe's choice of advantage estimator, policy loss, KL use and shaping; the loop
is the same, and what an estimator needs (a critic, groups, a greedy baseline) is read from its
registry entry (:func:`~megarlhf.algorithms.advantages.estimator_needs`). Every rank runs it (SPMD under torchrun or srun). One step:

 1. data       this data-parallel replica draws its share of the step's global batch of prompts
 2. wake       trainer state (actor, critic, reference) is offloaded; the engine's weights wake
 3. sync       actor shards -> full HF-named tensors -> engine, in buckets, verified bit for bit
 4. rollout    the engine samples ``rollout.n_samples`` responses per prompt, with their log-probs
 5. sleep      the engine sleeps and the trainer state comes back
 6. reward     verifiers, user functions (per sample, time-bounded) and a learned reward model
               (DAPO's dynamic sampling repeats 1-6 until the batch holds enough informative groups)
 7. score      reference log-probs, critic values, a teacher's log-probs (algorithm.distill: and its
               top-k), and the actor's log-probs (the PPO "old" policy)
               unless the update's own forward gives the same numbers (one optimizer step per RL
               step); at step 0 the actor's log-probs must equal the engine's (the step-0 gate)
 8. advantage  the configured estimator (GRPO, GAE, RLOO, ...) (+ a distillation advantage: reverse KL)
 9. update     the actor with the configured policy loss (+ KL / entropy / distillation terms: GKD) and the critic
10. record     metrics.jsonl + TensorBoard + console; a checkpoint every ``checkpoint.every`` steps;
               evaluation every ``eval.every`` steps (before that step's update) and at the end

Steps 1-6 live in :mod:`megarlhf.loops.collect` (2-5 in :mod:`megarlhf.rollout.phase`,
colocated or disaggregated engines), 6 in :mod:`megarlhf.loops.rewarding`, 7-8 in
:mod:`megarlhf.loops.experience`, 9 in :mod:`megarlhf.learner`.
"""
from __future__ import annotations

import time
from pathlib import Path

from megarlhf.algorithms.advantages import estimator_needs
from megarlhf.config.schema import RunConfig
from megarlhf.core import startup
from megarlhf.core.seeds import sample_seed
from megarlhf.learner import actor_update, build_actor, build_critic, build_reference, critic_update
from megarlhf.learner.teacher import build_teacher
from megarlhf.loops.collect import Collected, check_dataset_steps, first_on_policy_step
from megarlhf.loops.experience import build_experience, compute_advantages, score
from megarlhf.loops.pipeline import make_batches
from megarlhf.loops.policy_loop import open_policy_loop, scheduled_eval
from megarlhf.loops.rewarding import score_rewards
from megarlhf.loops.rollout_metrics import staleness_metrics
from megarlhf.records.host_syncs import StepSyncLog
from megarlhf.records.sample_log import SampleLog
from megarlhf.rollout.engines.sampling import greedy_sampling
from megarlhf.rollout.phase import serve_engine_rank
from megarlhf.run.context import RunContext, start_run


def train_rl(config: RunConfig) -> Path | None:
    """Runs ``config.train.steps`` RL steps (resuming if asked); returns the exported HF directory
    (None on the engine ranks of the disaggregated placement, which only serve rollouts)."""
    run = start_run(config, "train")
    if run.is_engine_rank:
        serve_engine_rank(config, run.runtime)
        return None
    check_dataset_steps(config, run.runtime.dp.size)
    prompts, eval_prompts = run.train_and_eval_prompts()
    run.actor = build_actor(config, run.runtime)
    startup.mark("actor")
    run.reference = build_reference(config, run.runtime, run.actor) if config.algorithm.uses_reference else None
    run.critic = build_critic(config, run.runtime) if estimator_needs(config.algorithm.estimator).critic else None
    run.teacher = build_teacher(config, run.runtime) if config.teacher is not None else None
    startup.mark("reference_critic_and_teacher")
    # the loop's own gate measures the natural floor when it checks the first rollout before any update (step 0)
    sampler, first_step = open_policy_loop(run, prompts, step0_gate=first_on_policy_step(config) == 0)
    batches = make_batches(run, sampler, prompts)  # steps 1-6
    batches.restore(run.resumed, first_step)
    run.samples = SampleLog(run.run_dir, run.tokenizer, per_step=config.logging.samples_per_step,
                            runtime=run.runtime, resume_after_step=first_step - 1)
    syncs = StepSyncLog(config.logging.run_dir, run.runtime.launch.rank, config.logging.count_host_syncs)
    for step in range(first_step, config.train.steps):
        run.checkpointer.poll()  # publishes a background save (checkpoint.async_save) whose write has finished
        start = time.perf_counter()
        metrics = scheduled_eval(run, eval_prompts, step)
        with syncs.step(step):
            rollout_start = time.perf_counter()
            got = batches.next(step)  # 1-6
            run.samples.write(step, "train", got.examples, got.rollout, got.rewards)
            baseline = greedy_baseline(run, got, step)
            rollout_s = time.perf_counter() - rollout_start
            metrics.update(staleness_metrics(got.rollout, step, run.runtime))
            batch = build_experience(got.rollout, got.group_offset, run.pad_id, run.runtime.device)
            train_start = time.perf_counter()
            metrics.update(rl_update(run, got, batch, step, baseline))  # 7-9
            run.actor.policy_version = step + 1  # a sync before the next step (the checkpoint's) sends these
            metrics.update({"time/rollout_s": rollout_s, "time/train_s": time.perf_counter() - train_start,
                            "time/step_s": time.perf_counter() - start})
            run.log_step(step, metrics)  # 10
        run.save(step + 1, lambda: {"sampler": sampler.state_dict(), **batches.state(step + 1)})
    run.checkpointer.close()
    if config.eval.every:  # also after resuming a finished run: the recorder cut the final record, it is redone
        run.log_step(config.train.steps, scheduled_eval(run, eval_prompts, config.train.steps, last=True))
    return run.finish_policy_run()


def rl_update(run: RunContext, got: Collected, batch, step: int, baseline: list[float] | None) -> dict[str, float]:
    """Steps 7-9 on this replica's share of the step (``batch``: its experience): score, advantages, the
    actor's (and critic's) update; at the first step that samples (step 0, unless GKD's lmbda trains it on dataset
    responses) the gates' checks and the calibration's metrics."""
    config = run.config
    gated = step == first_on_policy_step(config)  # step 0, unless it trains on dataset responses (GKD's lmbda)
    batch, score_metrics = score(batch, config, run.actor, run.reference, run.critic,  # 7
                                 gates=run.rollout if gated else None, teacher=run.teacher)
    batch, advantage_metrics = compute_advantages(batch, got.rewards, config, run.runtime, baseline,  # 8
                                                  got.informative)
    update = actor_update(run.actor, batch, config, on_nonfinite=config.train.on_nonfinite)  # 9
    if run.critic is not None:
        update.update(critic_update(run.critic, batch, config, on_nonfinite=config.train.on_nonfinite))
    metrics = {}
    if gated:
        _check_step0_ppo_kl(config, run.rollout.tolerances.step0_ppo_kl, update)
        metrics.update(run.rollout.calibration)
    return {**metrics, **got.metrics, **score_metrics, **advantage_metrics, **update}


def greedy_baseline(run: RunContext, got: Collected, step: int) -> list[float] | None:
    """For an estimator that declares ``greedy_baseline`` (ReMax): each sample's baseline is the reward
    of one greedy response to its prompt (the engine keeps the weights it was just synced with)."""
    config = run.config
    if not estimator_needs(config.algorithm.estimator).greedy_baseline:
        return None
    greedy, _ = run.rollout.generate(got.examples, greedy_sampling(config.rollout, run.stop_token_ids),
                                     sample_seed(config.seed, step, got.group_offset, 1), sync_weights=False)
    greedy_rewards, _, _ = score_rewards(run.reward, got.examples, greedy, run.tokenizer, config)
    return [greedy_rewards[p] for p in got.rollout.prompt_index]


def _check_step0_ppo_kl(config: RunConfig, tolerance: float, metrics: dict[str, float]) -> None:
    """With one optimizer update per step, the step-0 ratio is exactly 1, so ``actor/ppo_kl`` must be 0
    (within the dtype's gate, :mod:`megarlhf.rollout.sync.gates`)."""
    if config.train.updates_per_step == 1 and not abs(metrics.get("actor/ppo_kl", 0.0)) <= tolerance:
        raise RuntimeError(f"step-0 gate: actor/ppo_kl = {metrics['actor/ppo_kl']:.3e} with one update per step "
                           f"(must be 0 within gates.step0_ppo_kl={tolerance:g}: the actor scored the batch it "
                           f"trains on)")
