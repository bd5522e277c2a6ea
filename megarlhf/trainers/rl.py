"""The RL driver: GRPO, PPO with a GAE critic, DAPO, Dr.GRPO, RLOO, REINFORCE++, ReMax, GSPO, CISPO.

The algorithm is the recipe's choice of advantage estimator, policy loss, KL use and shaping; the loop
is the same. Every rank runs it (SPMD under torchrun or srun). One step:

 1. data       this data-parallel replica draws its share of the step's global batch of prompts
 2. wake       trainer state (actor, critic, reference) is offloaded; the engine's weights wake
 3. sync       actor shards -> full HF-named tensors -> vLLM, in buckets, checksum-verified
 4. rollout    vLLM samples ``rollout.n_samples`` responses per prompt, with their log-probs
 5. sleep      the engine sleeps and the trainer state comes back
 6. reward     verifiers, user functions or a reward model, per sample and time-bounded
 7. score      reference log-probs, critic values, and the actor's log-probs (the PPO "old" policy)
               unless the update's own forward gives the same numbers (one optimizer step per RL
               step); at step 0 the actor's log-probs must equal the engine's (the step-0 gate)
 8. advantage  the configured estimator (GRPO, GAE, RLOO, ...)
 9. update     the actor with the configured policy loss (+ KL / entropy terms) and the critic
10. record     metrics.jsonl + TensorBoard + console; a checkpoint every ``checkpoint.every`` steps;
               evaluation every ``eval.every`` steps (before that step's update) and at the end

Steps 2-5 live in :mod:`megarlhf.trainers.rollout_phase` (colocated or disaggregated engines), 6-8 in
:mod:`megarlhf.trainers.experience`, 9 in :mod:`megarlhf.training`.
"""
from __future__ import annotations

import time
from pathlib import Path

from megarlhf.config.schema import RunConfig
from megarlhf.metrics import MetricsRecorder, plot_curves
from megarlhf.rewards import CombinedReward
from megarlhf.rollout.engine import SamplingConfig
from megarlhf.trainers.evaluate import evaluate
from megarlhf.trainers.experience import (build_experience, compute_advantages, rollout_metrics, score,
                                          score_rewards)
from megarlhf.trainers.rollout_phase import build_rollout_phase, sample_seed, serve_engine_rank
from megarlhf.trainers.run import start_run
from megarlhf.trainers.run_checkpoint import RunCheckpointer
from megarlhf.training import actor_update, build_actor, build_critic, build_reference, critic_update
from model_providers.hf_checkpoint import export_hf_checkpoint


def _sampling(config: RunConfig, stop_token_ids: tuple[int, ...], greedy: bool = False) -> SamplingConfig:
    r = config.rollout
    if greedy:  # ReMax's baseline: one greedy response per prompt
        return SamplingConfig(n=1, temperature=0.0, max_new_tokens=r.max_new_tokens, stop_token_ids=stop_token_ids)
    return SamplingConfig(n=r.n_samples, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, stop_token_ids=stop_token_ids)


def train_rl(config: RunConfig) -> Path | None:
    """Runs ``config.train.steps`` RL steps (resuming if asked); returns the exported HF directory
    (None on the engine ranks of the disaggregated placement, which only serve rollouts)."""
    run = start_run(config)
    if run.is_engine_rank:
        serve_engine_rank(config)
        return None
    prompts = run.load_prompts(config.data.train_path)
    eval_prompts = run.load_prompts(config.data.eval_path) if config.data.eval_path else None
    actor = build_actor(config)
    reference = build_reference(config) if config.algorithm.uses_reference else None
    critic = build_critic(config) if config.algorithm.uses_critic else None
    phase = build_rollout_phase(config, actor, [m for m in (critic, reference) if m is not None])
    reward = CombinedReward(config.reward)
    checkpointer = RunCheckpointer(config, {"actor": actor, **({"critic": critic} if critic else {})})
    sampler, first_step = run.resume(checkpointer, len(prompts))
    steps = config.train.steps
    recorder = MetricsRecorder(run.run_dir, total_steps=steps, tensorboard=config.logging.tensorboard,
                               rank=run.launch.rank, resume_after_step=first_step - 1)
    stop = (run.tokenizer.eos_token_id,)
    share = config.train.global_batch_size // run.dp_size

    def run_eval(step: int) -> dict[str, float]:
        if eval_prompts is None:
            return {}
        return evaluate(phase, eval_prompts.examples, reward, run.tokenizer, config, step, run.dp_rank,
                        run.dp_size, stop)

    for step in range(first_step, steps):
        start = time.perf_counter()
        examples = [prompts[i] for i in sampler.next_batch()]                                  # 1 data
        offset = run.dp_rank * share
        metrics = run_eval(step) if config.eval.every and step % config.eval.every == 0 else {}
        rollout_start = time.perf_counter()
        rollout, phase_metrics = phase.generate(                                               # 2-5
            [e.prompt_ids for e in examples], _sampling(config, stop),
            sample_seed(config.seed, step, offset, config.rollout.n_samples))
        rollout_s = time.perf_counter() - rollout_start
        rewards, reward_metrics = score_rewards(reward, examples, rollout, run.tokenizer, config)  # 6
        baseline = None
        if config.algorithm.estimator == "remax":
            greedy, _ = phase.generate([e.prompt_ids for e in examples], _sampling(config, stop, greedy=True),
                                       sample_seed(config.seed, step, offset, 1))
            greedy_rewards, _ = score_rewards(reward, examples, greedy, run.tokenizer, config)
            baseline = greedy_rewards[rollout.prompt_index]
        batch = build_experience(rollout, offset, run.pad_id)
        train_start = time.perf_counter()
        batch, score_metrics = score(batch, config, actor, reference, critic, gate_step0=step == 0)  # 7
        batch, advantage_metrics = compute_advantages(batch, rewards, config, baseline)          # 8
        update_metrics = actor_update(actor, batch, config, on_nonfinite=config.train.on_nonfinite)  # 9
        if critic is not None:
            update_metrics.update(critic_update(critic, batch, config, on_nonfinite=config.train.on_nonfinite))
        _check_step0_ppo_kl(step, config, update_metrics)
        metrics.update({**phase_metrics, **reward_metrics, **rollout_metrics(rollout, rewards),  # 10 record
                        **score_metrics, **advantage_metrics, **update_metrics,
                        "time/rollout_s": rollout_s, "time/train_s": time.perf_counter() - train_start,
                        "time/step_s": time.perf_counter() - start})
        recorder.log(step, metrics)
        if checkpointer.should_save(step + 1, steps):  # checkpoints are named by completed steps
            checkpointer.save(step + 1, {"step": step + 1, "sampler": sampler.state_dict()})
    if first_step < steps and eval_prompts is not None:
        recorder.log(steps, run_eval(steps))
    recorder.close()
    reward.close()
    phase.close()
    export_dir = export_hf_checkpoint(actor.model, actor.provider, run.run_dir / "hf", source_dir=config.model.path,
                                      overwrite=True)
    if run.is_main:
        plot_curves(run.run_dir / "metrics.jsonl", run.run_dir / "curves.png")
    run.log(f"exported the trained actor to {export_dir}")
    return export_dir


def _check_step0_ppo_kl(step: int, config: RunConfig, metrics: dict[str, float]) -> None:
    """With one optimizer update per step, the step-0 ratio is exactly 1, so ``actor/ppo_kl`` must be 0."""
    if step == 0 and config.train.updates_per_step == 1 and abs(metrics.get("actor/ppo_kl", 0.0)) > 1e-6:
        raise RuntimeError(f"step-0 gate: actor/ppo_kl = {metrics['actor/ppo_kl']:.3e} with one update per step "
                           f"(must be 0: the actor scored the batch it trains on)")
