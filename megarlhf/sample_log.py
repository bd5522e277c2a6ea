"""Generated text of a run, for reading what the policy does: ``samples.jsonl`` in the run directory.

Metrics say how much reward a run collects, not how; a policy that games its verifier (restating the
question's expression as "the answer", an empty response that a lenient checker accepts) shows up here
first. Every step the main rank writes its first ``logging.samples_per_step`` training samples and, at
each evaluation, as many evaluation samples: prompt, response (decoded with special tokens, so tool
calls and observations of multi-turn episodes are visible), reward, ground truth, finish reason and
length. A resumed run cuts the file back to the steps its checkpoint completed, like ``metrics.jsonl``.
"""
from __future__ import annotations

import json
from pathlib import Path

from megarlhf.data.prompts import PromptExample
from megarlhf.metrics import truncate_records_after
from megarlhf.rollout.engine import RolloutBatch


class SampleLog:
    """Appends decoded samples to ``<run_dir>/samples.jsonl`` (a no-op on ranks other than 0, or with
    ``per_step`` = 0)."""

    def __init__(self, run_dir: str | Path, tokenizer, *, per_step: int, rank: int = 0,
                 resume_after_step: int | None = None):
        self.active = rank == 0 and per_step > 0
        self.per_step = per_step
        self.tokenizer = tokenizer
        self.path = Path(run_dir) / "samples.jsonl"
        if self.active and resume_after_step is not None:
            truncate_records_after(self.path, resume_after_step)

    def write(self, step: int, kind: str, examples: list[PromptExample], rollout: RolloutBatch,
              rewards: list[float]) -> None:
        """The first ``per_step`` samples of ``rollout`` (``kind``: "train" or "eval")."""
        if not self.active:
            return
        records = []
        for k in range(min(self.per_step, len(rollout.response_ids))):
            example = examples[rollout.prompt_index[k]]
            response = rollout.response_ids[k]
            records.append({"step": step, "kind": kind, "prompt": example.prompt,
                            "response": self.tokenizer.decode(response, skip_special_tokens=False),
                            "reward": rewards[k], "ground_truth": example.ground_truth,
                            "finish_reason": rollout.finish_reasons[k] if rollout.finish_reasons else None,
                            "response_tokens": len(response)})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
