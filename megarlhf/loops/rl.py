"""The RL driver: GRPO, PPO with a GAE critic, DAPO, Dr.GRPO, RLOO, REINFORCE++, ReMax, GSPO, CISPO.

The algorithm is the recipe's choice of advantage estimator, policy loss, KL use and shaping; the loop
is the same, and what an estimator needs (a critic, groups, a greedy baseline) is read from its
registry entry (``config.algorithm.needs``). Every rank runs it (SPMD under torchrun or srun). One step:

 1. data       this data-parallel replica draws its share of the step's global batch of prompts
 2. wake       trainer state (actor, critic, reference) is offloaded; the engine's weights wake
 3. sync       actor shards -> full HF-named tensors -> engine, in buckets, verified bit for bit
 4. rollout    the engine samples ``rollout.n_samples`` responses per prompt, with their log-probs
 5. sleep      the engine sleeps and the trainer state comes back
 6. reward     verifiers, user functions (per sample, time-bounded) and a learned reward model
               (DAPO's dynamic sampling repeats 1-6 until the batch holds enough informative groups)
 7. score      reference log-probs, critic values, and the actor's log-probs (the PPO "old" policy)
               unless the update's own forward gives the same numbers (one optimizer step per RL
               step); at step 0 the actor's log-probs must equal the engine's (the step-0 gate)
 8. advantage  the configured estimator (GRPO, GAE, RLOO, ...)
 9. update     the actor with the configured policy loss (+ KL / entropy terms) and the critic
10. record     metrics.jsonl + TensorBoard + console; a checkpoint every ``checkpoint.every`` steps;
               evaluation every ``eval.every`` steps (before that step's update) and at the end

Steps 1-6 live in :mod:`megarlhf.loops.collect` (2-5 in :mod:`megarlhf.rollout.phase`,
colocated or disaggregated engines), 6 in :mod:`megarlhf.loops.rewarding`, 7-8 in
:mod:`megarlhf.loops.experience`, 9 in :mod:`megarlhf.learner`.
"""
from __future__ import annotations

import time
from pathlib import Path

from megarlhf.config.schema import RunConfig
from megarlhf.rewards import CombinedReward
from megarlhf.rollout.engines.sampling import greedy_sampling
from megarlhf.records.sample_log import SampleLog
from megarlhf.loops.collect import Collected
from megarlhf.loops.evaluate import evaluate
from megarlhf.loops.experience import build_experience, compute_advantages, score
from megarlhf.loops.rewarding import build_reward, score_rewards
from megarlhf.loops.pipeline import make_batches
from megarlhf.core.seeds import sample_seed
from megarlhf.rollout.phase import Calibration, build_rollout_phase, serve_engine_rank
from megarlhf.run.context import start_run
from megarlhf.run.checkpointer import RunCheckpointer
from megarlhf.learner import actor_update, build_actor, build_critic, build_reference, critic_update
from megarlhf.algorithms.advantages import estimator_needs


def train_rl(config: RunConfig) -> Path | None:
    """Runs ``config.train.steps`` RL steps (resuming if asked); returns the exported HF directory
    (None on the engine ranks of the disaggregated placement, which only serve rollouts)."""
    run = start_run(config)
    runtime = run.runtime
    if run.is_engine_rank:
        serve_engine_rank(config, runtime)
        return None
    prompts, eval_prompts = run.train_and_eval_prompts()
    actor = build_actor(config, runtime)
    reference = build_reference(config, runtime, actor) if config.algorithm.uses_reference else None
    critic = build_critic(config, runtime) if estimator_needs(config.algorithm.estimator).critic else None
    reward, reward_model = build_reward(config, runtime, run.tokenizer)
    eval_reward = CombinedReward(config.eval_reward) if config.eval_reward is not None else None
    stop = (run.tokenizer.eos_token_id,)
    # before the resume: the gates calibrate while actor and engines hold the checkpoint at model.path
    phase = build_rollout_phase(config, actor, [m for m in (critic, reference, reward_model) if m is not None],
                                run.tokenizer, Calibration.of_run(config, prompts.examples, stop))
    checkpointer = RunCheckpointer(config, {"actor": actor, **({"critic": critic} if critic else {})})
    sampler, first_step = run.resume(checkpointer, len(prompts))
    batches = make_batches(phase, sampler, prompts, reward, run.tokenizer, config, runtime, stop)  # steps 1-6
    batches.restore(run.resumed, first_step)
    steps = config.train.steps
    recorder = run.open_recorder(steps, first_step)
    samples = SampleLog(run.run_dir, run.tokenizer, per_step=config.logging.samples_per_step,
                        runtime=runtime, resume_after_step=first_step - 1)

    def run_eval(step: int) -> dict[str, float]:
        if eval_prompts is None or eval_reward is None:
            return {}
        return evaluate(phase, eval_prompts.examples, eval_reward, run.tokenizer, config, step, runtime, stop,
                        samples)

    for step in range(first_step, steps):
        checkpointer.poll()  # publishes a background save (checkpoint.async_save) whose write has finished
        start = time.perf_counter()
        metrics = run_eval(step) if config.eval.every and step % config.eval.every == 0 else {}
        rollout_start = time.perf_counter()
        got = batches.next(step)  # 1-6
        samples.write(step, "train", got.examples, got.rollout, got.rewards)
        baseline = greedy_baseline(phase, got, reward, run.tokenizer, config, step, stop)
        rollout_s = time.perf_counter() - rollout_start
        batch = build_experience(got.rollout, got.group_offset, run.pad_id, runtime.device)
        train_start = time.perf_counter()
        batch, score_metrics = score(batch, config, actor, reference, critic,  # 7
                                     gates=phase.tolerances if step == 0 else None)
        batch, advantage_metrics = compute_advantages(batch, got.rewards, config, runtime, baseline,  # 8
                                                      got.informative)
        update_metrics = actor_update(actor, batch, config, on_nonfinite=config.train.on_nonfinite)  # 9
        if critic is not None:
            update_metrics.update(critic_update(critic, batch, config, on_nonfinite=config.train.on_nonfinite))
        if step == 0:
            _check_step0_ppo_kl(config, phase.tolerances.step0_ppo_kl, update_metrics)
            metrics.update(phase.calibration)
        metrics.update({**got.metrics, **score_metrics, **advantage_metrics, **update_metrics,  # 10 record
                        "time/rollout_s": rollout_s, "time/train_s": time.perf_counter() - train_start,
                        "time/step_s": time.perf_counter() - start})
        recorder.log(step, metrics)
        if checkpointer.should_save(step + 1, steps):  # checkpoints are named by completed steps
            checkpointer.save(step + 1, {"step": step + 1, "sampler": sampler.state_dict(),
                                         **batches.state(step + 1)})
    checkpointer.close()
    if config.eval.every:  # also after resuming a finished run: the recorder cut the final record, it is redone
        recorder.log(steps, run_eval(steps))
    return run.finish_policy_run(recorder, [reward, eval_reward, phase], actor)


def greedy_baseline(phase, got: Collected, reward: CombinedReward, tokenizer, config: RunConfig, step: int,
                    stop: tuple[int, ...]) -> list[float] | None:
    """For an estimator that declares ``greedy_baseline`` (ReMax): each sample's baseline is the reward
    of one greedy response to its prompt (the engine keeps the weights it was just synced with)."""
    if not estimator_needs(config.algorithm.estimator).greedy_baseline:
        return None
    greedy, _ = phase.generate(got.examples, greedy_sampling(config.rollout, stop),
                               sample_seed(config.seed, step, got.group_offset, 1), sync_weights=False)
    greedy_rewards, _ = score_rewards(reward, got.examples, greedy, tokenizer, config)
    return [greedy_rewards[p] for p in got.rollout.prompt_index]


def _check_step0_ppo_kl(config: RunConfig, tolerance: float, metrics: dict[str, float]) -> None:
    """With one optimizer update per step, the step-0 ratio is exactly 1, so ``actor/ppo_kl`` must be 0
    (within the dtype's gate, :mod:`megarlhf.rollout.sync.gates`)."""
    if config.train.updates_per_step == 1 and not abs(metrics.get("actor/ppo_kl", 0.0)) <= tolerance:
        raise RuntimeError(f"step-0 gate: actor/ppo_kl = {metrics['actor/ppo_kl']:.3e} with one update per step "
                           f"(must be 0 within gates.step0_ppo_kl={tolerance:g}: the actor scored the batch it "
                           f"trains on)")
