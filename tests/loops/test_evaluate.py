"""Evaluation: pass@k against the unbiased estimator computed by hand and by brute force over every
k-subset of the samples; accuracy and pass@k of evaluate() on a scripted rollout (which samples are
correct is known). An eval set smaller than the data-parallel size runs in test_rl_matrix.py."""
from __future__ import annotations

from pathlib import Path

import itertools
from dataclasses import dataclass
from math import comb
from pathlib import Path

import pytest
import torch

from megarlhf.config.train import EvalConfig
from megarlhf.config.model import ModelConfig
from megarlhf.config.schema import RunConfig
from megarlhf.data.prompts import PromptExample
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.loops.evaluate import evaluate, pass_at_k
from megarlhf.run.context import RunContext
from parallel.runtime import LaunchEnv, ParallelGroup, Runtime


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c correct) that hold a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - comb(3, 2) / comb(5, 2))  # 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(4, 0, 3) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert pass_at_k(6, 5, 2) == 1.0  # fewer wrong samples than k: every draw holds a correct one


@pytest.mark.parametrize("n", [1, 3, 6])
def test_pass_at_k_equals_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


@dataclass
class _Result:
    rewards: list
    failures: tuple = ()
    metrics: dict = None

    def __post_init__(self):
        self.metrics = self.metrics or {}


class _Tokenizer:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Phase:
    """Scripted engine: sample j of a prompt is correct when j < the prompt's ``correct`` count."""

    def __init__(self, correct: dict[int, int]):
        self.correct, self.calls = correct, []

    def generate(self, prompts, sampling, seed, sync_weights=True):
        self.calls.append(len(prompts))
        batch = RolloutBatch()
        for i, example in enumerate(prompts):  # PromptExamples, as the rollout phase takes them
            ids = example.prompt_ids
            for j in range(sampling.n):
                batch.prompt_index.append(i)
                batch.prompt_ids.append(ids)
                batch.response_ids.append([ids[0], int(j < self.correct[ids[0]])])
                batch.logprobs.append([0.0, 0.0])
                batch.finish_reasons.append("stop")
        return batch, {}


def _reward(samples):
    return _Result([float(s.response.endswith(" 1")) for s in samples])


def _runtime(dp_rank: int = 0) -> Runtime:
    alone = ParallelGroup.alone()
    return Runtime(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "none"), torch.device("cpu"), alone, alone, alone, alone,
                   alone, ParallelGroup(dp_rank, 1, None), alone, alone, 0)


def test_evaluate_accuracy_and_pass_at_k_on_a_scripted_rollout():
    correct = {10: 0, 11: 1, 12: 4}  # per prompt: correct samples out of 4
    examples = [PromptExample(i, f"p{i}", [tok], None) for i, tok in enumerate(correct)]
    config = RunConfig(model=ModelConfig(path="unused"), eval=EvalConfig(n_samples=4, pass_at_k=[1, 2, 4]))
    phase = _Phase(correct)
    run = RunContext(config, _runtime(), Path("unused"), _Tokenizer(), "eval", eval_reward=_reward, rollout=phase)
    metrics = evaluate(run, examples, 0)
    assert metrics["eval/prompts"] == 3 and metrics["eval/accuracy"] == pytest.approx(5 / 12)
    for k in (1, 2, 4):
        expected = sum(brute_force_pass_at_k(4, c, k) for c in correct.values()) / 3
        assert metrics[f"eval/pass@{k}"] == pytest.approx(expected)
    assert metrics["eval/pass@2"] == pytest.approx((0 + 0.5 + 1) / 3)
