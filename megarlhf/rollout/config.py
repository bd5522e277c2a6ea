"""The rollout settings of a run and the sampling/scoring contract built from them.

:class:`RolloutConfig` is the ``rollout`` section of a recipe and the only place rollout defaults live;
the engines, the weight sync and the rollout phase take it (or an object built from it here) rather
than keeping their own copies of its values.

The sampling/scoring contract (one definition for the engine and the trainer). A rollout sample's
log-prob, as the engine reports it and as the trainer recomputes it, is::

    log softmax(logits / T_s)[token],   T_s = rollout.temperature if it is > 0 else 1

over the whole vocabulary (Megatron's padded rows excluded): vLLM is asked for ``raw_logprobs`` at
``T in {0, 1}`` and for ``processed_logprobs`` (after temperature) otherwise; the HF engine computes the
same quantity; the trainer divides its logits by :func:`scoring_temperature`. Top-p / top-k filtering
is refused (see :data:`RolloutConfig.refused_keys`): samples drawn from a filtered distribution have a
behaviour policy that the full-softmax log-probs do not describe, so PPO ratios and truncated-IS
weights would be silently biased, and vLLM's processed log-probs under filtering would fail the step-0
gate at ``T != 1``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from megarlhf.core.dtypes import check_dtype_name
from megarlhf.envs.api import EnvConfig
from megarlhf.core.errors import ConfigError

ROLLOUT_BACKENDS = ("vllm", "hf")
MAX_STALENESS = 16  # rollout.max_staleness: beyond this the samples say little about the trained policy


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _positive_ints(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
               f"{type(owner).__name__}.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class RolloutPlacementConfig:
    """Where rollout engines live. ``colocate``: on every rank, with the trainers (offload around
    rollouts). ``disaggregated``: on the last ``num_engine_ranks`` ranks, trainers on the others."""

    mode: Literal["colocate", "disaggregated"] = "colocate"
    num_engine_ranks: int = 0  # disaggregated only

    def validate(self, world_size: int) -> None:
        if self.mode not in ("colocate", "disaggregated"):
            raise ConfigError(f"RolloutPlacementConfig.mode={self.mode!r}: must be 'colocate' or 'disaggregated'")
        if self.mode == "colocate" and self.num_engine_ranks != 0:
            raise ConfigError(f"RolloutPlacementConfig.num_engine_ranks={self.num_engine_ranks}: only the "
                              f"disaggregated mode has separate engine ranks (colocate needs 0)")
        if self.mode == "disaggregated" and not 1 <= self.num_engine_ranks < world_size:
            raise ConfigError(f"RolloutPlacementConfig.num_engine_ranks={self.num_engine_ranks}: the disaggregated "
                              f"mode needs at least 1 engine rank and 1 trainer rank out of {world_size} ranks")

    def num_trainer_ranks(self, world_size: int) -> int:
        self.validate(world_size)
        return world_size - self.num_engine_ranks


@dataclass
class WeightSyncConfig:
    """How trainer weights reach the engines (:mod:`megarlhf.rollout.weight_sync`). The probe's
    tolerance is a verification gate (:mod:`megarlhf.rollout.gates`), not a setting of the sync."""

    bucket_mb: float = 256.0  # full HF tensors travel in buckets of at most this size (a larger tensor alone)
    probe_sequences: int = 4  # random sequences scored by engine and trainer after each sync (0: no probe)
    probe_length: int = 64
    # and one more as long as the run's longest sequence (prompt + response budget), at most this many tokens
    # (0: none), so that the probe reaches the positions the run uses: past a RoPE scaling boundary or a
    # sliding window. Bounded because an engine scores a prompt over the whole vocabulary at once (vLLM's
    # prompt log-probs hold [tokens, vocab] logits and an fp32 copy, outside its memory profile): 2048
    # tokens of a 152k vocabulary are ~1.9 GB
    probe_max_length: int = 2048
    # the gates' calibration (megarlhf.rollout.calibration): the engine reloads model.path from disk so
    # that its parameters are compared bit for bit with the trainer's conversion of it (false: skipped)
    check_checkpoint: bool = True
    # prompts of the run sampled as the rollout samples them (n_samples each) and scored by the trainer,
    # whose gap sets the step-0 tolerances (0: the probe's floor sets them)
    calibration_prompts: int = 4
    # how a LoRA policy (model.lora) reaches the engines: "merged" sends W + (alpha/rank) B A of every
    # adapted layer into a plain engine; "adapter" sends only the adapters to a LoRA-enabled vLLM engine
    # that keeps the frozen base (megarlhf.rollout.adapter_sync). Both are verified bit for bit.
    lora: Literal["merged", "adapter"] = "merged"

    def __post_init__(self):
        _check(self.lora in ("merged", "adapter"),
               f"WeightSyncConfig.lora={self.lora!r}: must be 'merged' or 'adapter'")
        _check(isinstance(self.check_checkpoint, bool),
               f"WeightSyncConfig.check_checkpoint must be true or false, got {self.check_checkpoint!r}")
        _check(isinstance(self.calibration_prompts, int) and not isinstance(self.calibration_prompts, bool)
               and self.calibration_prompts >= 0,
               f"WeightSyncConfig.calibration_prompts must be an int >= 0, got {self.calibration_prompts!r}")
        _check(self.bucket_mb > 0, f"WeightSyncConfig.bucket_mb must be > 0, got {self.bucket_mb}")
        _check(isinstance(self.probe_sequences, int) and self.probe_sequences >= 0,
               f"WeightSyncConfig.probe_sequences must be an int >= 0, got {self.probe_sequences!r}")
        _check(isinstance(self.probe_length, int) and self.probe_length >= 2,
               f"WeightSyncConfig.probe_length must be an int >= 2, got {self.probe_length!r}")
        _check(isinstance(self.probe_max_length, int) and not isinstance(self.probe_max_length, bool)
               and self.probe_max_length >= 0,
               f"WeightSyncConfig.probe_max_length must be an int >= 0, got {self.probe_max_length!r}")


@dataclass
class RolloutConfig:
    """Generation settings of the RL loop (and of evaluation, which overrides the temperature)."""

    backend: Literal["vllm", "hf"] = "vllm"  # vLLM engines, or plain transformers (no vLLM needed)
    n_samples: int = 8  # responses per prompt
    temperature: float = 1.0
    max_new_tokens: int = 1024
    dtype: str | None = None  # the engines' dtype; None: model.dtype
    tensor_parallel_size: int = 1  # of each vLLM engine
    kv_cache_mb: int = 512  # KV cache of each vLLM engine (vLLM's kv_cache_memory_bytes, CPU and GPU)
    enforce_eager: bool = True  # no torch.compile / CUDA graphs: fast engine start, slower decoding
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    # colocate (engines on every rank, trainer state offloaded around rollouts) or disaggregated
    # (engines on the last placement.num_engine_ranks ranks, weights broadcast to them)
    placement: RolloutPlacementConfig = field(default_factory=RolloutPlacementConfig)
    # off-policy training (disaggregated placement): k >= 1 lets the engines generate the next batch while
    # the trainers update, with weights at most k updates older than those that train on it (the weights
    # are synced only when the next batch would be staler); 0 is synchronous (megarlhf.loops.pipeline)
    max_staleness: int = 0
    # multi-turn, tool-calling rollouts (megarlhf.rollout.multi_turn); None: one model turn per sample
    env: EnvConfig | None = None
    # token budget of one multi-turn response (model turns + observations); None: max_new_tokens x max_turns
    max_response_tokens: int | None = None

    # Keys users bring from other frameworks that megarlhf refuses, with the reason (the config loader
    # reports it instead of "unknown key").
    refused_keys: ClassVar[dict[str, str]] = {
        key: ("top-p / top-k filtering is refused: the trainer scores samples with the full softmax at "
              "rollout.temperature, so samples from a filtered distribution would bias the PPO ratio and the "
              "truncated-IS weights (and fail the step-0 gate at temperature != 1); sample with "
              "rollout.temperature alone")
        for key in ("top_p", "top_k", "min_p")}

    def __post_init__(self):
        _positive_ints(self, "n_samples", "max_new_tokens", "tensor_parallel_size", "kv_cache_mb")
        _check(self.backend in ROLLOUT_BACKENDS,
               f"RolloutConfig.backend={self.backend!r}: must be one of {', '.join(ROLLOUT_BACKENDS)}")
        _check(self.temperature >= 0.0, f"RolloutConfig.temperature must be >= 0, got {self.temperature}")
        if self.dtype is not None:
            check_dtype_name(self.dtype, "RolloutConfig.dtype")
        _check(isinstance(self.max_staleness, int) and not isinstance(self.max_staleness, bool)
               and 0 <= self.max_staleness <= MAX_STALENESS,
               f"RolloutConfig.max_staleness must be an int in [0, {MAX_STALENESS}] (0: synchronous; k: samples "
               f"at most k updates old), got {self.max_staleness!r}")
        _check(self.max_staleness == 0 or self.placement.mode == "disaggregated",
               f"RolloutConfig.max_staleness={self.max_staleness} needs rollout.placement.mode='disaggregated': "
               f"colocated engines share the devices with the trainers, so generation and training cannot overlap")
        _check(self.env is None or self.tensor_parallel_size == 1,
               f"RolloutConfig.env (multi-turn rollouts) runs one engine per rank or per engine rank: "
               f"tensor_parallel_size must be 1, got {self.tensor_parallel_size}")
        _check(self.max_response_tokens is None or (isinstance(self.max_response_tokens, int)
                                                    and self.max_response_tokens >= self.max_new_tokens),
               f"RolloutConfig.max_response_tokens must be null or an int >= max_new_tokens "
               f"({self.max_new_tokens}), got {self.max_response_tokens!r}")
        _check(self.backend == "vllm" or (self.tensor_parallel_size == 1 and self.placement.mode == "colocate"),
               f"RolloutConfig.backend='hf' runs one colocated engine per rank: tensor_parallel_size must be 1 "
               f"(got {self.tensor_parallel_size}) and placement.mode 'colocate' (got {self.placement.mode!r})")

    def engine_dtype(self, model_dtype: str) -> str:
        return self.dtype or model_dtype

    @property
    def response_budget(self) -> int:
        """Tokens one response may hold: a single turn's, or the multi-turn budget."""
        if self.env is None:
            return self.max_new_tokens
        return self.max_response_tokens or self.max_new_tokens * self.env.max_turns


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


def scoring_temperature(rollout: RolloutConfig) -> float:
    """The temperature the trainer scores rollout samples at (the contract of the module docstring)."""
    return rollout.temperature if rollout.temperature > 0 else 1.0


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds a rank-``rank`` adapter (vLLM pads with zeros)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank}: vLLM serves adapters of rank at most {VLLM_LORA_RANKS[-1]}")


def vllm_logprobs_mode(rollout: RolloutConfig) -> str:
    """vLLM's ``logprobs_mode`` that reports the contract's log-probs for ``rollout.temperature``."""
    return "raw_logprobs" if rollout.temperature in (0.0, 1.0) else "processed_logprobs"
