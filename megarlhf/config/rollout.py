"""The ``rollout`` section: engines, sampling, weight sync, placement, off-policy staleness and multi-turn
environments.

The sampling/scoring contract: a sample's log-prob, as the engine reports it and as the trainer
recomputes it, is ``log softmax(logits / T)[token]`` over the whole vocabulary, ``T`` =
:func:`scoring_temperature`. Top-p / top-k filtering is refused (:data:`RolloutConfig.refused_keys`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from megarlhf.config.validate import check, check_timeout, positive_ints
from megarlhf.core.dtypes import check_dtype_name
from megarlhf.core.errors import ConfigError


@dataclass
class EnvConfig:
    """The ``rollout.env`` settings of a multi-turn run (the only place their defaults live)."""

    name: str  # a registered environment (ENVIRONMENTS) or a dotted path 'pkg.module:factory'
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the factory with each sample's metadata
    max_turns: int = 4  # model turns per episode; the runner ends the episode after the last one
    timeout_s: float = 5.0  # per tool call; a call that runs longer becomes "error: ... timed out"
    max_observation_chars: int = 2048  # longer observations are cut to this many characters
    parser: str = "tokenizer"  # tool-call format, a name in megarlhf.envs.parsers.PARSERS
    num_workers: int = 4  # tool calls run concurrently (worker processes of a stateless environment, else threads)
    # describe the tools in every prompt (the chat template's tools= where it renders them, else text in the
    # system message); off when the data already describes them (megarlhf.envs.prompting)
    describe_tools: bool = True
    worker_memory_mb: int = 4096  # address space of each worker process (a stateless environment's)
    # episodes that may end in an error (the model's output broke the chat template or the tokenizer) over
    # the run, per rank: each ends with finish reason "error"; one more stops the run (megarlhf.rollout.multi_turn)
    failed_episodes_budget: int = 32

    def __post_init__(self):
        if not (isinstance(self.name, str) and self.name):
            raise ValueError(f"EnvConfig.name must be a non-empty string, got {self.name!r}")
        if not (isinstance(self.kwargs, dict) and all(isinstance(k, str) for k in self.kwargs)):
            raise ValueError(f"EnvConfig.kwargs must be a mapping with string keys, got {self.kwargs!r}")
        for name in ("max_turns", "max_observation_chars", "num_workers", "worker_memory_mb"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"EnvConfig.{name} must be an int >= 1, got {value!r}")
        budget = self.failed_episodes_budget
        if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0):
            raise ValueError(f"EnvConfig.failed_episodes_budget must be an int >= 0, got {budget!r}")
        if not isinstance(self.describe_tools, bool):
            raise ValueError(f"EnvConfig.describe_tools must be true or false, got {self.describe_tools!r}")
        check_timeout(self.timeout_s, "EnvConfig.timeout_s")


MAX_STALENESS = 16  # rollout.max_staleness: beyond this the samples say little about the trained policy


@dataclass(frozen=True)
class RolloutPlacementConfig:
    """Where rollout engines live. ``colocate``: on every rank, with the trainers (offload around
    rollouts). ``disaggregated``: on the last ``num_engine_ranks`` ranks, trainers on the others."""

    mode: Literal["colocate", "disaggregated"] = "colocate"
    num_engine_ranks: int = 0  # disaggregated only
    # disaggregated: an engine whose processes die (or that stops answering) is replaced, at most this many
    # times per engine rank in a run; its lost samples are generated again after a verified sync
    max_engine_restarts: int = 2
    # disaggregated: a generation that has not returned after this many seconds counts as a dead engine (0: none)
    engine_timeout_s: float = 0.0

    def __post_init__(self):
        if not isinstance(self.max_engine_restarts, int) or isinstance(self.max_engine_restarts, bool) \
                or self.max_engine_restarts < 0:
            raise ConfigError(f"RolloutPlacementConfig.max_engine_restarts must be an int >= 0, got "
                              f"{self.max_engine_restarts!r}")
        if isinstance(self.engine_timeout_s, bool) or not isinstance(self.engine_timeout_s, (int, float)) \
                or not 0 <= self.engine_timeout_s < float("inf"):
            raise ConfigError(f"RolloutPlacementConfig.engine_timeout_s must be a number of seconds >= 0 (0: no "
                              f"timeout), got {self.engine_timeout_s!r}")

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
    """How trainer weights reach the engines (:mod:`megarlhf.rollout.sync.weights`). The probe's
    tolerance is a verification gate (:mod:`megarlhf.rollout.sync.gates`), not a setting of the sync."""

    bucket_mb: float = 256.0  # full HF tensors travel in buckets of at most this size (a larger tensor alone)
    probe_sequences: int = 4  # random sequences scored by engine and trainer after each sync (0: no probe)
    probe_length: int = 64
    # and one more as long as the run's longest sequence (prompt + response budget), at most this many tokens
    # (0: none), so that the probe reaches the positions the run uses: past a RoPE scaling boundary or a
    # sliding window. Bounded because an engine scores a prompt over the whole vocabulary at once (vLLM's
    # prompt log-probs hold [tokens, vocab] logits and an fp32 copy, outside its memory profile): 2048
    # tokens of a 152k vocabulary are ~1.9 GB
    probe_max_length: int = 2048
    # the gates' calibration (megarlhf.rollout.sync.calibration): the engine reloads model.path from disk so
    # that its parameters are compared bit for bit with the trainer's conversion of it (false: skipped)
    check_checkpoint: bool = True
    # prompts of the run sampled as the rollout samples them (n_samples each) and scored by the trainer,
    # whose gap sets the step-0 tolerances (0: the probe's floor sets them)
    calibration_prompts: int = 4
    # how a LoRA policy (model.lora) reaches the engines: "merged" sends W + (alpha/rank) B A of every
    # adapted layer into a plain engine; "adapter" sends only the adapters to a LoRA-enabled vLLM engine
    # that keeps the frozen base (megarlhf.rollout.sync.adapters). Both are verified bit for bit.
    lora: Literal["merged", "adapter"] = "merged"

    def __post_init__(self):
        check(self.lora in ("merged", "adapter"),
              f"WeightSyncConfig.lora={self.lora!r}: must be 'merged' or 'adapter'")
        check(isinstance(self.check_checkpoint, bool),
              f"WeightSyncConfig.check_checkpoint must be true or false, got {self.check_checkpoint!r}")
        check(isinstance(self.calibration_prompts, int) and not isinstance(self.calibration_prompts, bool)
              and self.calibration_prompts >= 0,
              f"WeightSyncConfig.calibration_prompts must be an int >= 0, got {self.calibration_prompts!r}")
        check(self.bucket_mb > 0, f"WeightSyncConfig.bucket_mb must be > 0, got {self.bucket_mb}")
        check(isinstance(self.probe_sequences, int) and self.probe_sequences >= 0,
              f"WeightSyncConfig.probe_sequences must be an int >= 0, got {self.probe_sequences!r}")
        check(isinstance(self.probe_length, int) and self.probe_length >= 2,
              f"WeightSyncConfig.probe_length must be an int >= 2, got {self.probe_length!r}")
        check(isinstance(self.probe_max_length, int) and not isinstance(self.probe_max_length, bool)
              and self.probe_max_length >= 0,
              f"WeightSyncConfig.probe_max_length must be an int >= 0, got {self.probe_max_length!r}")


@dataclass
class RolloutConfig:
    """Generation settings of the RL loop (and of evaluation, which overrides the temperature)."""

    # the rollout engine, a name in megarlhf.rollout.engines.ENGINES: vllm, hf (plain transformers, no vLLM
    # needed), fake (deterministic responses, for tests); its entry declares the layouts it supports
    backend: str = "vllm"
    n_samples: int = 8  # responses per prompt
    temperature: float = 1.0
    max_new_tokens: int = 1024
    dtype: str | None = None  # the engines' dtype; None: model.dtype
    tensor_parallel_size: int = 1  # of each engine
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
        positive_ints(self, "n_samples", "max_new_tokens", "tensor_parallel_size", "kv_cache_mb")
        check(isinstance(self.backend, str) and bool(self.backend),
              f"RolloutConfig.backend must be a non-empty string, got {self.backend!r}")
        check(self.temperature >= 0.0, f"RolloutConfig.temperature must be >= 0, got {self.temperature}")
        if self.dtype is not None:
            check_dtype_name(self.dtype, "RolloutConfig.dtype")
        check(isinstance(self.max_staleness, int) and not isinstance(self.max_staleness, bool)
              and 0 <= self.max_staleness <= MAX_STALENESS,
              f"RolloutConfig.max_staleness must be an int in [0, {MAX_STALENESS}] (0: synchronous; k: samples "
              f"at most k updates old), got {self.max_staleness!r}")
        check(self.max_staleness == 0 or self.placement.mode == "disaggregated",
              f"RolloutConfig.max_staleness={self.max_staleness} needs rollout.placement.mode='disaggregated': "
              f"colocated engines share the devices with the trainers, so generation and training cannot overlap")
        check(self.placement.mode == "colocate" or self.tensor_parallel_size == 1,
              f"RolloutConfig.placement.mode='disaggregated' runs one engine per engine rank: tensor_parallel_size "
              f"must be 1, got {self.tensor_parallel_size}")
        check(self.env is None or self.tensor_parallel_size == 1,
              f"RolloutConfig.env (multi-turn rollouts) runs one engine per rank or per engine rank: "
              f"tensor_parallel_size must be 1, got {self.tensor_parallel_size}")
        check(self.max_response_tokens is None or (isinstance(self.max_response_tokens, int)
                                                    and self.max_response_tokens >= self.max_new_tokens),
              f"RolloutConfig.max_response_tokens must be null or an int >= max_new_tokens "
              f"({self.max_new_tokens}), got {self.max_response_tokens!r}")

    def engine_dtype(self, model_dtype: str) -> str:
        return self.dtype or model_dtype

    @property
    def response_budget(self) -> int:
        """Tokens one response may hold: a single turn's, or the multi-turn budget."""
        if self.env is None:
            return self.max_new_tokens
        return self.max_response_tokens or self.max_new_tokens * self.env.max_turns


def scoring_temperature(rollout: RolloutConfig) -> float:
    """The temperature the trainer scores rollout samples at (the contract of the module docstring)."""
    return rollout.temperature if rollout.temperature > 0 else 1.0
