"""The checks of a run's config that need the registries: every registry name it gives, and what the chosen
entries declare they need or support.

The settings dataclasses (:mod:`megarlhf.config`) sit below the registries they name, so they check only
their own values; :func:`check_config` finishes the job before a run builds anything: every run's
:func:`megarlhf.run.context.start_run`, ``megarlhf plan`` and a NeMo-Run task at submission call it. Every
message names the key.
"""
from __future__ import annotations

from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from megarlhf.algorithms.preference_losses import PREFERENCE_LOSSES
from megarlhf.config.reward import RewardConfig
from megarlhf.config.schema import RunConfig
from megarlhf.data.prompts import PromptDataset
from megarlhf.core.errors import ConfigError, DataError
from megarlhf.envs import ENVIRONMENTS, PARSERS
from megarlhf.records.tracking import TRACKERS
from megarlhf.rewards import REWARDS
from megarlhf.rewards.api import resolve_reward, wants_ground_truth
from megarlhf.rollout.engines import ENGINES


def check_config(config: RunConfig) -> None:
    """Raises a :class:`ConfigError` naming the key of the first problem found."""
    _check_algorithm(config)
    _check_rewards(config)
    _check_rollout(config)
    _check_preference(config)
    unknown = [b for b in config.logging.backends if b not in TRACKERS]
    if unknown:
        raise ConfigError(f"logging.backends: unknown tracking backend(s) {unknown}; known: "
                          f"{', '.join(TRACKERS.names())}")


def _check_algorithm(config: RunConfig) -> None:
    algorithm = config.algorithm
    ADVANTAGE_ESTIMATORS.check_name(algorithm.estimator, "algorithm.estimator")
    POLICY_LOSSES.check_name(algorithm.policy_loss, "algorithm.policy_loss")
    KL_ESTIMATORS.check_name(algorithm.kl.estimator, "algorithm.kl.estimator")
    needs = ADVANTAGE_ESTIMATORS.get(algorithm.estimator).needs
    if needs.groups and config.rollout.n_samples < 2:
        raise ConfigError(f"algorithm.estimator {algorithm.estimator!r} compares samples of a prompt: "
                          f"rollout.n_samples must be >= 2, got {config.rollout.n_samples}")
    if needs.greedy_baseline and config.rollout.max_staleness:
        raise ConfigError(f"rollout.max_staleness={config.rollout.max_staleness} with algorithm.estimator="
                          f"{algorithm.estimator!r}: its greedy baseline is generated inside the step with the "
                          f"current weights; use max_staleness=0")


def _check_rewards(config: RunConfig) -> None:
    for key, specs in (("reward.functions", config.reward.functions),
                       ("eval.reward_functions", config.eval.reward_functions or [])):
        for i, spec in enumerate(specs):
            REWARDS.check_name(spec.name, f"{key}.{i}", dotted_path=True)
    judge = config.reward.judge
    if judge is not None and judge.backend is not None:
        ENGINES.check_name(judge.backend, "reward.judge.backend")


def _check_rollout(config: RunConfig) -> None:
    rollout = config.rollout
    ENGINES.check_name(rollout.backend, "rollout.backend")
    spec = ENGINES.get(rollout.backend)
    if rollout.tensor_parallel_size > 1 and not spec.tensor_parallel:
        raise ConfigError(f"rollout.backend={rollout.backend!r} runs one engine per rank: "
                          f"rollout.tensor_parallel_size must be 1, got {rollout.tensor_parallel_size}")
    if config.model.lora is not None and rollout.weight_sync.lora == "adapter":
        if spec.adapter_rank is None:
            raise ConfigError(f"rollout.weight_sync.lora='adapter' needs an engine that loads adapters alone; "
                              f"rollout.backend={rollout.backend!r} takes merged weights (weight_sync.lora='merged')")
        try:
            spec.adapter_rank(config.model.lora.rank)
        except ValueError as err:
            raise ConfigError(f"model.lora.rank: {err}") from None
    if rollout.env is not None:
        ENVIRONMENTS.check_name(rollout.env.name, "rollout.env.name", dotted_path=True)
        PARSERS.check_name(rollout.env.parser, "rollout.env.parser")


def _check_preference(config: RunConfig) -> None:
    preference = config.preference
    PREFERENCE_LOSSES.check_name(preference.loss, "preference.loss")
    if not PREFERENCE_LOSSES.get(preference.loss).label_smoothing and preference.params.label_smoothing != 0:
        raise ConfigError(f"preference.loss={preference.loss!r} has no label smoothing; set "
                          f"preference.params.label_smoothing=0 (got {preference.params.label_smoothing})")


def check_ground_truths(dataset: PromptDataset, rewards: RewardConfig | None, answer_key: str) -> None:
    """Refuses prompts without an answer when a reward function of ``rewards`` scores against it."""
    needing = [spec.name for spec in (rewards.functions if rewards is not None else [])
               if wants_ground_truth(resolve_reward(spec.name))]
    if rewards is not None and rewards.judge is not None and rewards.judge.uses_reference:
        needing.append("judge (its template quotes the {reference})")
    missing = [example.index for example in dataset.examples if example.ground_truth is None]
    if needing and missing:
        raise DataError(f"{dataset.source}: {len(missing)} of {len(dataset)} prompts have no {answer_key!r} field "
                        f"(data.answer_key; first: row {missing[0]}), which the reward {needing[0]} scores against; "
                        f"set data.answer_key to the field holding the answers")
