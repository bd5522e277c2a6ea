"""The experience batch and run config shared by the training workers (built identically on every rank).

Eight sequences in four GRPO groups of two, each group's samples with the same prompt (so packed
micro-batches share it, :mod:`parallel.shared_prefix`), prompt lengths 2..7 and response lengths 3..14 (so
micro-batches of a 40-token budget differ in size and a context-parallel split pads some sequences), and
sequence rewards for the registry's GRPO estimator.
"""
from __future__ import annotations

import torch

from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs
from megarlhf.config.algorithm import AdvantageConfig
from megarlhf.config.model import ModelConfig
from megarlhf.config.train import OptimConfig, TrainConfig
from megarlhf.config.schema import RunConfig
from megarlhf.config.data import DataConfig
from megarlhf.learner import ExperienceBatch

PROMPT_LENGTHS = (5, 7, 2, 3)  # one per group of two
RESPONSE_LENGTHS = (9, 12, 4, 14, 7, 3, 11, 6)
VOCAB = 384


def experience(vocab: int = VOCAB, seed: int = 0) -> ExperienceBatch:
    """Token ids, response mask, group ids and GRPO advantages (from the registry) of the batch."""
    g = torch.Generator().manual_seed(seed)
    prompts = [p for n in PROMPT_LENGTHS for p in [torch.randint(0, vocab, (n,), generator=g).tolist()] * 2]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in RESPONSE_LENGTHS]
    batch = ExperienceBatch.from_sequences(prompts, responses, device=torch.device("cpu"),
                                           group_ids=[i // 2 for i in range(len(prompts))])
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.3])
    out = ADVANTAGE_ESTIMATORS.get("grpo")(
        AdvantageInputs(rewards=rewards, response_mask=batch.response_mask, group_ids=batch.group_ids),
        AdvantageConfig())
    return batch.replace(advantages=out.advantages.float(), returns=out.returns.float())


def noise(shape, seed: int, scale: float) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def run_config(model_dir: str, critic_dir: str | None = None, **train) -> RunConfig:
    """fp32, clipping off (gradients are compared), a 40-token micro-batch budget, KL loss and an
    entropy bonus on, sampling temperature 0.8."""
    config = RunConfig(model=ModelConfig(path=model_dir, dtype="float32", critic_path=critic_dir),
                       data=DataConfig(train_path="unused.jsonl"),
                       optim=OptimConfig(lr=1e-3, clip_grad=0.0, use_distributed_optimizer=True),
                       train=TrainConfig(**{"micro_batch_tokens": 40, **train}))
    config.algorithm.entropy_coef = 0.01
    config.algorithm.kl.coef = 0.05
    config.rollout.temperature = 0.8
    return config


def hf_logprobs(hf, ids: torch.Tensor, temperature: float):
    """Token-aligned log-probs and entropies [B, L] from HF's full logits (column 0 is 0): the naive
    reference (log_softmax of every logit)."""
    logp = torch.log_softmax(hf(input_ids=ids).logits.float() / temperature, dim=-1)
    token = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    zero = token.new_zeros(ids.shape[0], 1)
    return torch.cat([zero, token], 1), torch.cat([zero, entropy], 1)


def hf_values(rm, ids: torch.Tensor) -> torch.Tensor:
    """Token-aligned values [B, L] of an HF ...ForSequenceClassification: the score of the hidden state
    before each token (column 0 is 0)."""
    scores = rm.model(input_ids=ids).last_hidden_state @ rm.score.weight[0]
    return torch.cat([scores.new_zeros(scores.shape[0], 1), scores[:, :-1]], 1)
