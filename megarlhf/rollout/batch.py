"""What every rollout engine returns (:class:`RolloutBatch`) and the prompt checks every engine makes,
shared by the vLLM engine (:mod:`megarlhf.rollout.engine`) and the transformers engine
(:mod:`megarlhf.rollout.hf_engine`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length")


@dataclass
class RolloutBatch:
    """Generated samples, prompt-major: sample ``k`` answers prompt ``prompt_index[k]``."""

    prompt_index: list[int] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)  # of the sampled tokens, per position
    finish_reasons: list[str] = field(default_factory=list)  # "stop" (EOS / stop token) or "length"
    # multi-turn rollouts only (megarlhf.rollout.multi_turn; empty otherwise): per response token 1 if the
    # model generated it, 0 for observation tokens; the environment's reward and the tool calls per sample
    loss_masks: list[list[int]] = field(default_factory=list)
    env_rewards: list[float] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    # an engine recording routing (routing replay R3) only, else empty: per sample its routing record,
    # int16 [prompt + response tokens, moe_layers, top_k] on the host (megarlhf.rollout.routing)
    routed_experts: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)


def check_prompt_ids(prompts: list[list[int]], vocab_size: int, max_model_len: int | None = None) -> None:
    """Raises naming the prompt: an empty prompt, token ids outside the vocabulary, or (with
    ``max_model_len``) no room left for a generated token."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"rollout prompt {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"rollout prompt {i} has token ids {bad[:5]} outside [0, {vocab_size})")
        if max_model_len is not None and len(p) >= max_model_len:
            raise ValueError(f"rollout prompt {i} has {len(p)} tokens; max_model_len={max_model_len} "
                             "leaves no room for a generated token")
