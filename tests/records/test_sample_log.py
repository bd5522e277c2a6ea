"""SampleLog: what it writes, on which rank, and how a resume cuts it back."""
import json
from pathlib import Path

import pytest

from megarlhf.data.prompts import PromptExample
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.records.sample_log import SampleLog
from megarlhf.testing.launch import run_torchrun

WORKER = Path(__file__).with_name("_worker_sample_log.py")


class _Tokenizer:
    def decode(self, ids, skip_special_tokens):
        assert skip_special_tokens is False  # tool-call tokens and observations stay visible
        return " ".join(f"t{i}" for i in ids)


def _batch():
    examples = [PromptExample(0, "What is 1 + 2?", [5], "3"), PromptExample(1, "What is 2 + 2?", [6], "4")]
    rollout = RolloutBatch(prompt_index=[0, 0, 1], prompt_ids=[[5], [5], [6]],
                           response_ids=[[1, 2], [3], [4, 4, 4]], finish_reasons=["stop", "length", "stop"])
    return examples, rollout, [1.0, 0.0, 0.5]


def test_writes_the_first_samples_of_a_step(tmp_path):
    log = SampleLog(tmp_path, _Tokenizer(), per_step=2)
    log.write(0, "train", *_batch())
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert records == [
        {"step": 0, "kind": "train", "prompt": "What is 1 + 2?", "response": "t1 t2", "reward": 1.0,
         "ground_truth": "3", "finish_reason": "stop", "response_tokens": 2, "policy_versions": None},
        {"step": 0, "kind": "train", "prompt": "What is 1 + 2?", "response": "t3", "reward": 0.0,
         "ground_truth": "3", "finish_reason": "length", "response_tokens": 1, "policy_versions": None}]


def test_zero_per_step_writes_nothing(tmp_path):
    SampleLog(tmp_path, _Tokenizer(), per_step=0).write(0, "eval", *_batch())
    assert not (tmp_path / "samples.jsonl").exists()


def _read(path):
    return [(r["step"], r["response"], r["reward"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.slow  # a 2-rank run (~16 s)
def test_first_samples_of_the_whole_batch_at_dp2_once_at_tp2(tmp_path):
    """At DP=2 rank 0 held only 2 of the first 3 samples (an evaluation split over replicas recorded too
    few samples, and none at all when rank 0's share was empty); at TP=2 the peers do not write twice."""
    run_torchrun(WORKER, 2, [str(tmp_path)], timeout_s=300)
    assert _read(tmp_path / "tp1" / "samples.jsonl") == [
        (0, "t0", 0.0), (0, "t1", 0.0), (0, "t10", 1.0), (1, "t10", 1.0), (1, "t11", 1.0)]
    assert _read(tmp_path / "tp2" / "samples.jsonl") == [(0, "t0", 0.0), (0, "t1", 0.0)]


def test_resume_cuts_back_to_the_checkpointed_steps(tmp_path):
    log = SampleLog(tmp_path, _Tokenizer(), per_step=1)
    for step in range(4):
        log.write(step, "train", *_batch())
    SampleLog(tmp_path, _Tokenizer(), per_step=1, resume_after_step=1)
    steps = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


def test_records_the_policy_versions_of_each_token_as_runs(tmp_path):
    """A sample whose tokens came from two policy versions (a partial rollout, a share generated again): its
    versions are written as [version, tokens] runs in token order."""
    examples, rollout, rewards = _batch()
    rollout.policy_versions = [[3, 3], [4], [3, 4, 4]]
    SampleLog(tmp_path, _Tokenizer(), per_step=3).write(5, "train", examples, rollout, rewards)
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["policy_versions"] for r in records] == [[[3, 2]], [[4, 1]], [[3, 1], [4, 2]]]
