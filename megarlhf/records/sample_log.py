"""Generated text of a run, for reading what the policy does: ``samples.jsonl`` in the run directory.

Metrics say how much reward a run collects, not how; a policy that games its verifier (restating the question's
expression as "the answer", an empty response that a lenient checker accepts) shows up here first. Every step
the main rank writes the first ``logging.samples_per_step`` training samples and, at each evaluation, as many
evaluation samples: prompt, response (decoded with special tokens, so tool calls and observations of multi-turn
episodes are visible), reward, ground truth, finish reason, length and the policy versions of its tokens
(``[[version, tokens], ...]`` in token order, a version being the number of RL steps whose updates the sampling
weights held; null for a dataset response). "First" is over the whole batch in data-parallel order, not over the
main rank's share: each replica's first samples are gathered to it, so the file does not depend on the
data-parallel layout (at DP=2 an evaluation of 4 prompts with one sample each still records 4). A resumed run
cuts the file back to the steps its checkpoint completed, like ``metrics.jsonl``.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

from megarlhf.data.prompts import PromptExample
from megarlhf.records.metrics import truncate_records_after
from megarlhf.rollout.engines.sampling import RolloutBatch
from parallel.runtime import Runtime


class SampleLog:
    """Appends decoded samples to ``<run_dir>/samples.jsonl`` from global rank 0. ``write`` is collective
    over the data-parallel group of rank 0 (the ranks at tensor, pipeline and context rank 0); on every
    other rank, and with ``per_step`` = 0, it is a no-op. ``runtime`` None: a single process."""

    def __init__(self, run_dir: str | Path, tokenizer, *, per_step: int, runtime: Runtime | None = None,
                 resume_after_step: int | None = None):
        in_main_replica_group = runtime is None or runtime.tp.rank == runtime.pp.rank == runtime.cp.rank == 0
        self.gathers = per_step > 0 and in_main_replica_group
        self.active = self.gathers and (runtime is None or runtime.launch.rank == 0)
        self.runtime = runtime
        self.per_step = per_step
        self.tokenizer = tokenizer
        self.path = Path(run_dir) / "samples.jsonl"
        if self.active and resume_after_step is not None:
            truncate_records_after(self.path, resume_after_step)

    def write(self, step: int, kind: str, examples: list[PromptExample], rollout: RolloutBatch,
              rewards: list[float]) -> None:
        """The first ``per_step`` samples of the batch whose share on this replica is ``rollout`` (``kind``:
        "train" or "eval"); a replica with an empty share still calls it."""
        if not self.gathers:
            return
        records = self._records(step, kind, examples, rollout, rewards)
        if self.runtime is not None and self.runtime.dp.size > 1:
            shares = self.runtime.all_gather_objects(records, over="dp")
            records = [r for share in shares for r in share][:self.per_step]
        if not self.active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))

    def _records(self, step: int, kind: str, examples: list[PromptExample], rollout: RolloutBatch,
                 rewards: list[float]) -> list[dict]:
        records = []
        for k in range(min(self.per_step, len(rollout.response_ids))):
            example = examples[rollout.prompt_index[k]]
            response = rollout.response_ids[k]
            records.append({"step": step, "kind": kind, "prompt": example.prompt,
                            "response": self.tokenizer.decode(response, skip_special_tokens=False),
                            "reward": rewards[k], "ground_truth": example.ground_truth,
                            "finish_reason": rollout.finish_reasons[k] if rollout.finish_reasons else None,
                            "response_tokens": len(response)})
            records[-1]["policy_versions"] = (version_runs(rollout.policy_versions[k]) if rollout.policy_versions
                                              else None)
        return records


def version_runs(versions: list[int]) -> list[list[int]]:
    """A response's per-token policy versions as runs ``[[version, tokens], ...]`` in token order."""
    return [[version, len(list(run))] for version, run in itertools.groupby(versions)]
