"""The repository-editing task through ``megarlhf train`` as a user runs it (one process, the tiny Qwen2
model with room for the tools' description, HF rollouts): every sample is a ``repo`` episode with its tools described in the prompt, and its
reward is the ``repo_tests`` share of hidden tests. A random model writes no well-formed edit, so each
sample's reward is exactly the unedited repository's share, computed here in the sandbox."""
import json
import os
import subprocess
import sys

import pytest

from megarlhf.data.repo_tasks import write_tasks
from megarlhf.isolation.sandbox import isolation, run_tests
from model_providers.tiny_models import make_tiny_model

RECIPE = """
model: {path: MODEL, dtype: float32}
data: {train_path: DATA/train.jsonl, eval_path: DATA/heldout.jsonl, max_prompt_length: 1536, chat_template: always}
rollout:
  backend: hf
  n_samples: 2
  max_new_tokens: 8
  max_response_tokens: 64
  env: {name: repo, parser: hermes, max_turns: 3, num_workers: 2}
algorithm: {estimator: grpo}
optim: {lr: 1.0e-4}
train: {steps: 1, global_batch_size: 4, micro_batch_tokens: 4096}
reward: {functions: [{name: repo_tests}], num_workers: 2}
logging: {run_dir: RUN, samples_per_step: 4}
"""


@pytest.mark.skipif(isolation() != "namespaces", reason="the code sandbox cannot isolate here")
def test_a_repo_editing_run_through_the_command_line(tmp_path):
    model = make_tiny_model("qwen2", tmp_path / "model", seed=0, max_position_embeddings=2048)  # room for tools
    write_tasks(tmp_path / "data", 8, 2, seed=1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("MODEL", str(model)).replace("DATA", str(tmp_path / "data"))
                      .replace("RUN", str(tmp_path / "run")))
    done = subprocess.run([sys.executable, "-m", "megarlhf", "train", str(recipe)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {json.loads(line)["prompt"]: json.loads(line)
            for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()}
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for sample in samples:
        row = next(r for prompt, r in rows.items() if prompt in sample["prompt"])
        assert '"name": "edit"' in sample["prompt"]  # the tools are described to the model
        unedited = run_tests(row["program"], row["hidden_tests"], files=row["files"]).fraction
        assert sample["reward"] == pytest.approx(unedited, abs=1e-6), sample
