"""The checks of a run's config that need the registries: every registry name it gives, and what the chosen
entries declare they need or support.

The settings dataclasses (:mod:`megarlhf.config`) sit below the registries they name, so they check only
their own values; :func:`check_config` finishes the job before a run builds anything: every run's
:func:`megarlhf.run.context.start_run`, ``megarlhf plan`` and a NeMo-Run task at submission call it. Every
message names the key.
"""
from __future__ import annotations

import json
from pathlib import Path

from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from megarlhf.algorithms.distillation import DISTILL_LOSSES
from megarlhf.algorithms.preference_losses import PREFERENCE_LOSSES
from megarlhf.config.parallel import LayoutError, ParallelConfig
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
    _check_distill(config)
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
    if not needs.rewards and algorithm.distill is None:
        raise ConfigError(f"algorithm.estimator={algorithm.estimator!r} learns from no reward: it is for distillation "
                          f"alone (algorithm.distill with a teacher); use an estimator such as 'grpo'")
    if not needs.rewards and algorithm.kl_in_reward:
        raise ConfigError(f"algorithm.kl_mode='reward' puts the KL penalty in the rewards, which algorithm.estimator="
                          f"{algorithm.estimator!r} does not read: use kl_mode 'loss' or 'none'")
    if needs.greedy_baseline and config.rollout.max_staleness:
        raise ConfigError(f"rollout.max_staleness={config.rollout.max_staleness} with algorithm.estimator="
                          f"{algorithm.estimator!r}: its greedy baseline is generated inside the step with the "
                          f"current weights; use max_staleness=0")


def _check_distill(config: RunConfig) -> None:
    """What the distillation term declares (:class:`~megarlhf.algorithms.distillation.DistillNeeds`) against the
    settings that serve it."""
    distill = config.algorithm.distill
    if distill is None:
        return
    DISTILL_LOSSES.check_name(distill.loss, "algorithm.distill.loss")
    needs = DISTILL_LOSSES.get(distill.loss).needs
    if needs.top_k and distill.top_k < 1:
        raise ConfigError(f"algorithm.distill.loss={distill.loss!r} compares the student's distribution with the "
                          f"teacher's top-k: set algorithm.distill.top_k >= 1 (e.g. 20)")
    if not needs.top_k and distill.top_k:
        raise ConfigError(f"algorithm.distill.top_k={distill.top_k} is unused: algorithm.distill.loss="
                          f"{distill.loss!r} reads the teacher's log-prob of the sampled token only; set it to 0")
    if distill.lmbda < 1.0:
        where = f"algorithm.distill.lmbda={distill.lmbda:g} (steps on the prompts' dataset responses)"
        if not needs.dataset_responses:
            raise ConfigError(f"{where}: algorithm.distill.loss={distill.loss!r} learns on the student's own samples "
                              f"only; set lmbda to 1")
        if ADVANTAGE_ESTIMATORS.get(config.algorithm.estimator).needs.rewards:
            raise ConfigError(f"{where}: a dataset response has no policy-gradient advantage; set "
                              f"algorithm.estimator to 'none' (the teacher alone), or lmbda to 1")
        for problem, key in ((config.rollout.max_staleness, "rollout.max_staleness"),
                             (config.rollout.env is not None, "rollout.env"),
                             (config.algorithm.dynamic_sampling.enabled, "algorithm.dynamic_sampling.enabled")):
            if problem:
                raise ConfigError(f"{where} with {key} is not supported: set lmbda to 1 or turn {key} off")


def check_teacher(config: RunConfig, tokenizer, trainer_ranks: int) -> None:
    """The teacher reads the student's token ids: its tokenizer must give every token the student's id, and a
    loss that compares distributions (top-k) needs the student's vocabulary size. A layout of its own
    (``teacher.parallel``) must split the ``trainer_ranks`` and the teacher's layers. Raises naming the paths."""
    from transformers import AutoTokenizer

    path = config.teacher.model_path
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"teacher.model_path={path!r} is not an HF model directory (no config.json there)")
    try:
        teacher = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"teacher.model_path={path!r}: cannot load its tokenizer ({type(err).__name__})") from None
    ours, theirs = tokenizer.get_vocab(), teacher.get_vocab()
    differ = sorted(token for token in ours.keys() | theirs.keys() if ours.get(token) != theirs.get(token))
    if differ:
        shown = ", ".join(f"{t!r}: {ours.get(t)} vs {theirs.get(t)}" for t in differ[:3])
        raise ConfigError(f"teacher.model_path={path!r} has another tokenizer than model.path={config.model.path!r} "
                          f"({len(differ)} tokens differ, e.g. {shown}): the teacher scores the student's token ids, "
                          f"so it must share the student's tokenizer")
    distill = config.algorithm.distill
    if DISTILL_LOSSES.get(distill.loss).needs.top_k:
        sizes = [json.loads((Path(p) / "config.json").read_text()).get("vocab_size") for p in (config.model.path, path)]
        if sizes[0] != sizes[1]:
            raise ConfigError(f"algorithm.distill.loss={distill.loss!r} compares whole distributions: "
                              f"the teacher's vocab_size ({sizes[1]}, {path}) must equal the student's ({sizes[0]})")
        if distill.top_k > sizes[0]:
            raise ConfigError(f"algorithm.distill.top_k={distill.top_k} is more than the vocabulary ({sizes[0]} "
                              f"tokens): at most vocab_size (which is the whole distribution)")
    if config.teacher.parallel is not None:
        _check_teacher_layout(config.teacher.parallel, path, trainer_ranks)


def _check_teacher_layout(layout: ParallelConfig, path: str, trainer_ranks: int) -> None:
    """The teacher's own layout splits the trainer ranks, and its heads, FFN, experts and layers (the
    provider's own rules)."""
    from model_providers import get_provider

    try:
        layout.validate(trainer_ranks)
        get_provider(path).check_parallel(layout)
    except LayoutError as err:
        raise ConfigError(f"teacher.parallel (teacher {path}, {trainer_ranks} trainer ranks): {err}") from None


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
