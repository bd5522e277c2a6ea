"""An OpenEnv environment through ``megarlhf train`` as a user runs it: 2 ranks under torchrun, each starting
its own server of ``examples/openenv/sums_env`` from the recipe's command, the environment's rewards the only
reward (``reward.functions: []``). Every sample's final answer reaches the environment (``tools/answers``),
and every sample's reward is the environment's rule applied here to the response it logged."""
import json
import re
from pathlib import Path

import pytest

from megarlhf.testing.launch import train_with_cli
from model_providers.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SERVER_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
RECIPE = """
model: {path: MODEL, dtype: float32}
data: {train_path: DATA/train.jsonl, eval_path: DATA/train.jsonl, max_prompt_length: 32, chat_template: never}
rollout:
  backend: hf
  n_samples: 4
  temperature: 1.0
  max_new_tokens: 12
  max_response_tokens: 16
  env:
    name: openenv
    parser: hermes
    max_turns: 1
    describe_tools: false
    kwargs: {command: [SERVER, -m, uvicorn, sums_env.server.app:app, --app-dir, EXAMPLES, --port, "{port}"],
             tool_name: submit, answer_field: answer}
algorithm: {estimator: grpo}
optim: {lr: 1.0e-4}
train: {steps: 2, global_batch_size: 4, micro_batch_tokens: 1024}
reward: {functions: []}
logging: {run_dir: RUN, samples_per_step: 16}
"""


def _environment_reward(response: str, answer: str) -> float:  # sums_env's rule, written again
    numbers = re.findall(r"-?\d+(?:\.\d+)?", response)
    return 1.0 if numbers and float(numbers[-1]) == float(answer) else 0.0


def test_an_openenv_environment_is_the_reward_of_a_dp2_run(tmp_path):
    if not SERVER_PYTHON.exists():
        pytest.fail("OpenEnv's environment is missing: `make setup-openenv` (make test runs it) creates .venv-openenv")
    model = make_tiny_model("qwen2", tmp_path / "model", seed=0)
    (tmp_path / "data").mkdir()
    rows = [{"prompt": f"{a} plus {b} is", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (0, 5), (2, 2)]]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("MODEL", str(model)).replace("DATA", str(tmp_path / "data"))
                      .replace("RUN", str(tmp_path / "run")).replace("SERVER", str(SERVER_PYTHON))
                      .replace("EXAMPLES", str(ROOT / "examples" / "openenv")))
    trained, metrics = train_with_cli(recipe, tmp_path / "run")
    answers = {r["prompt"]: r["answer"] for r in rows}
    assert len(trained) == 2 * 4 * 4  # 2 steps x 4 prompts x 4 samples
    for sample in trained:
        answer = next(a for prompt, a in answers.items() if sample["prompt"].endswith(prompt))
        assert sample["reward"] == _environment_reward(sample["response"], answer), sample
    steps = [m for m in metrics if "tools/answers" in m]
    assert [m["tools/answers"] for m in steps] == [16.0, 16.0]  # summed over the 2 ranks
