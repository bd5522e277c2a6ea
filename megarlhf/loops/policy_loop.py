"""What the loops that train a policy on its own rollouts (RL, rejection sampling, online DPO) share: the
set-up around their models, and evaluation on the held-out prompts every ``eval.every`` steps."""
from __future__ import annotations

from megarlhf.core import startup
from megarlhf.data.prompts import PromptDataset
from megarlhf.data.sampler import PromptSampler
from megarlhf.loops.evaluate import evaluate
from megarlhf.loops.rewarding import build_reward
from megarlhf.rewards import CombinedReward
from megarlhf.rollout.phase import Calibration, build_rollout_phase
from megarlhf.run.checkpointer import RunCheckpointer
from megarlhf.run.context import RunContext


def open_policy_loop(run: RunContext, prompts: PromptDataset, step0_gate: bool = False,
                     **recorder_options) -> tuple[PromptSampler, int]:
    """Once ``run``'s models are built: its reward (with a learned reward model, if configured), the evaluation
    reward, the rollout engines, the checkpointer, the recorder. Returns the sampler and the first step,
    restored from a checkpoint when resuming (and the actor's policy version with it). ``step0_gate``: the loop
    checks the step-0 gate (which may then measure the natural floor itself:
    :mod:`megarlhf.rollout.sync.calibration`).

    The engines are built (and the gates calibrated, on the run's first prompts) while actor and engines
    both hold the checkpoint at ``model.path``: before the resume loads other weights.
    """
    config = run.config
    run.reward, run.reward_model = build_reward(config, run.runtime, run.tokenizer)
    startup.mark("reward")
    run.eval_reward = CombinedReward(config.eval_reward) if config.eval_reward is not None else None
    offloaded = [m for m in (run.critic, run.reference, run.teacher, run.reward_model) if m is not None]
    calibration = Calibration.of_run(config, prompts.examples, run.stop_token_ids, step0_gate)
    run.rollout = build_rollout_phase(config, run.actor, offloaded, run.tokenizer, calibration)
    run.checkpointer = RunCheckpointer(config, run.trained_models(), run.command)
    sampler, first_step = run.resume(len(prompts))
    run.actor.policy_version = first_step  # the updates of steps 0..first_step-1 (the loop counts the next ones)
    run.open_recorder(first_step, **recorder_options)
    return sampler, first_step


def scheduled_eval(run: RunContext, eval_prompts: PromptDataset | None, step: int, last: bool = False
                   ) -> dict[str, float]:
    """The evaluation of ``step`` when ``eval.every`` asks for one (and at the end, ``last``); {} otherwise or
    without held-out prompts or a verifier."""
    every = run.config.eval.every
    if not every or eval_prompts is None or run.eval_reward is None or (step % every and not last):
        return {}
    return evaluate(run, eval_prompts.examples, step)
