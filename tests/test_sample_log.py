"""SampleLog: what it writes, on which rank, and how a resume cuts it back."""
import json

from megarlhf.data.prompts import PromptExample
from megarlhf.rollout.engine import RolloutBatch
from megarlhf.sample_log import SampleLog


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
         "ground_truth": "3", "finish_reason": "stop", "response_tokens": 2},
        {"step": 0, "kind": "train", "prompt": "What is 1 + 2?", "response": "t3", "reward": 0.0,
         "ground_truth": "3", "finish_reason": "length", "response_tokens": 1}]


def test_other_ranks_and_zero_write_nothing(tmp_path):
    SampleLog(tmp_path, _Tokenizer(), per_step=4, rank=1).write(0, "eval", *_batch())
    SampleLog(tmp_path, _Tokenizer(), per_step=0).write(0, "eval", *_batch())
    assert not (tmp_path / "samples.jsonl").exists()


def test_resume_cuts_back_to_the_checkpointed_steps(tmp_path):
    log = SampleLog(tmp_path, _Tokenizer(), per_step=1)
    for step in range(4):
        log.write(step, "train", *_batch())
    SampleLog(tmp_path, _Tokenizer(), per_step=1, resume_after_step=1)
    steps = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
