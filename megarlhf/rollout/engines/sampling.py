"""What goes into a rollout engine's ``generate`` (:class:`SamplingConfig`, checked prompts) and what comes
out (:class:`RolloutBatch`)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from megarlhf.config.rollout import RolloutConfig

# "stop": an EOS or stop token (kept in the response); "length": the token limit; "abort": RolloutEngine.abort
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: an episode its output broke


@dataclass
class RolloutBatch:
    """Generated samples, prompt-major: sample ``k`` answers prompt ``prompt_index[k]``."""

    prompt_index: list[int] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)  # of the sampled tokens, per position
    finish_reasons: list[str] = field(default_factory=list)  # one of FINISH_REASONS
    # multi-turn rollouts only (megarlhf.rollout.multi_turn; empty otherwise): per response token 1 if the
    # model generated it, 0 for observation tokens; the environment's reward and the tool calls per sample
    loss_masks: list[list[int]] = field(default_factory=list)
    env_rewards: list[float] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    # an engine recording routing (routing replay R3) only, else empty: per sample its routing record,
    # int16 [prompt + response tokens, moe_layers, top_k] on the host (megarlhf.rollout.engines.routing)
    routed_experts: list = field(default_factory=list)
    # per response token, the policy version of the weights that sampled it (the number of RL steps whose
    # updates they hold; an observation token of a multi-turn episode: the version of the turn it follows);
    # stamped by the rollout phase (an engine knows no versions), empty when unknown (dataset responses)
    policy_versions: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)

    def stamp_versions(self, version: int) -> "RolloutBatch":
        """Every response token was sampled by the weights of policy ``version``; returns the batch."""
        self.policy_versions = [[version] * len(r) for r in self.response_ids]
        return self


def check_prompt_ids(prompts: list[list[int]], vocab_size: int, max_model_len: int | None = None,
                     what: str = "rollout prompt") -> None:
    """Raises naming the prompt (``what`` and its index): an empty prompt, token ids outside the vocabulary,
    or (with ``max_model_len``) no room left for a generated token."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"{what} {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"{what} {i} has token ids {bad[:5]} outside [0, {vocab_size})")
        if max_model_len is not None and len(p) >= max_model_len:
            raise ValueError(f"{what} {i} has {len(p)} tokens; max_model_len={max_model_len} "
                             "leaves no room for a generated token")



@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one batch: ``n`` responses per prompt at ``temperature`` (0: greedy).

    ``seed=None`` draws from the engine's own generator (not reproducible); a seed makes prompt ``i`` of
    a call use seeds ``seed + i * n + j`` for its samples ``j``, so a batch is reproducible as a whole.
    ``prompt_seeds`` (one per prompt) replaces ``seed + i * n`` by ``prompt_seeds[i]``: for prompts that
    are not consecutive positions of one batch (a subset of it, the running episodes of a multi-turn
    rollout), so that each keeps the seeds it has wherever and with whatever others it is generated.
    Built from the run config by :func:`rollout_sampling` / :func:`greedy_sampling` (no defaults of its
    own for what the config sets).
    """

    n: int
    temperature: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    prompt_seeds: tuple[int, ...] | None = None

    def validate(self, num_prompts: int | None = None) -> None:
        checks = [("n", self.n >= 1), ("temperature", self.temperature >= 0.0),
                  ("max_new_tokens", self.max_new_tokens >= 1)]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"SamplingConfig.{name}={getattr(self, name)!r} is out of range")
        if self.prompt_seeds is not None and num_prompts is not None and len(self.prompt_seeds) != num_prompts:
            raise ValueError(f"SamplingConfig.prompt_seeds has {len(self.prompt_seeds)} seeds for {num_prompts} prompts")

    def prompt_seed(self, i: int) -> int | None:
        """The seed of sample 0 of prompt ``i`` (sample ``j`` uses it + ``j``); None: unseeded."""
        if self.prompt_seeds is not None:
            return self.prompt_seeds[i]
        return None if self.seed is None else self.seed + i * self.n

    def for_prompts(self, indices: list[int]) -> "SamplingConfig":
        """The sampling of the prompts ``indices`` of this call, generated on their own with their seeds."""
        if self.seed is None and self.prompt_seeds is None:
            return self
        return replace(self, seed=None, prompt_seeds=tuple(self.prompt_seed(i) for i in indices))


def rollout_sampling(rollout: RolloutConfig, stop_token_ids: tuple[int, ...]) -> SamplingConfig:
    """The RL rollout's sampling: ``rollout.n_samples`` per prompt at ``rollout.temperature``."""
    return SamplingConfig(n=rollout.n_samples, temperature=rollout.temperature,
                          max_new_tokens=rollout.max_new_tokens, stop_token_ids=stop_token_ids)


def greedy_sampling(rollout: RolloutConfig, stop_token_ids: tuple[int, ...]) -> SamplingConfig:
    """One greedy response per prompt (a greedy-baseline estimator's baseline)."""
    return SamplingConfig(n=1, temperature=0.0, max_new_tokens=rollout.max_new_tokens,
                          stop_token_ids=stop_token_ids)
