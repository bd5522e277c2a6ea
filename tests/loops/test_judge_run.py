"""An LLM judge as part of the reward of ``megarlhf train``, as a user runs it: 2 ranks under torchrun, data
parallel (each rank judges its replica's samples), tensor parallel (the two ranks of the one replica judge
half of its samples each and gather), disaggregated in bf16 (the one trainer rank judges, beside an engine
rank), or with vLLM for both the policy's engine and the judge's (its engine core in a child process; slow).
The judge is a tiny model whose weights make it write "1" whatever it
reads, so every sample's logged reward is the rule reward plus the judge's weight; its prompts and replies go
through the real engine, template, quoting and parsing."""
import json
from pathlib import Path

import pytest
import torch

from megarlhf.rewards.api import REWARDS, RewardInput
from megarlhf.testing.launch import train_with_cli
from model_providers.tiny_models import make_tiny_model

RECIPE = """
model: {path: MODEL, dtype: float32}
data: {train_path: DATA/train.jsonl, max_prompt_length: 32, chat_template: never}
rollout: {backend: hf, n_samples: 4, temperature: 1.0, max_new_tokens: 12}
algorithm: {estimator: grpo}
optim: {lr: 1.0e-4}
train: {steps: 2, global_batch_size: 4, micro_batch_tokens: 1024}
reward:
  functions: [{name: exact_match}]
  judge: {model_path: JUDGE, weight: 0.5, template: "Q {question} R {reference} A {response} Grade:",
          answer_prefix: "Score:", score_pattern: 'Score:\\s*(\\d)', max_new_tokens: 3, max_model_len: 512}
logging: {run_dir: RUN, samples_per_step: 16}
"""


def make_constant_judge(out: Path) -> Path:
    """A tiny HF model whose greedy reply is "1" repeated: every token embeds to one vector ``v``, no block
    writes to the residual stream, and the LM head's only non-zero row, the token "1"'s, is ``v``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    path = make_tiny_model("llama", out, seed=1, max_position_embeddings=1024)
    one = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("1")
    weights = load_file(path / "model.safetensors")
    vector = weights["model.embed_tokens.weight"][0].clone()
    for name, tensor in weights.items():
        if name == "model.embed_tokens.weight":
            tensor.copy_(vector.expand_as(tensor))
        elif name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
            tensor.zero_()
        elif name == "model.norm.weight":
            tensor.fill_(1.0)
    weights["lm_head.weight"][one] = vector
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


LAYOUTS = {"dp2": [], "tp2": ["parallel.tensor_model_parallel_size=2"],
           "disaggregated_bf16": ["rollout.placement={mode: disaggregated, num_engine_ranks: 1}",
                                  "model.dtype=bfloat16", "reward.judge.dtype=bfloat16"],
           "vllm_dp2": ["rollout.backend=vllm", "reward.judge.backend=vllm", "rollout.kv_cache_mb=64",
                        "reward.judge.kv_cache_mb=64"]}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if "vllm" in name else name
                                    for name in LAYOUTS])
def test_a_judge_joins_the_reward_of_a_two_rank_run(tmp_path, layout):
    model = make_tiny_model("qwen2", tmp_path / "model", seed=0)
    judge = make_constant_judge(tmp_path / "judge")
    (tmp_path / "data").mkdir()
    rows = [{"prompt": f"{a} plus {b} is", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (0, 5), (2, 2)]]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("MODEL", str(model)).replace("JUDGE", str(judge))
                      .replace("DATA", str(tmp_path / "data")).replace("RUN", str(tmp_path / "run")))
    trained, metrics = train_with_cli(recipe, tmp_path / "run", LAYOUTS[layout])
    answers = {r["prompt"]: r["answer"] for r in rows}
    assert len(trained) == 2 * 4 * 4  # 2 steps x 4 prompts x 4 samples
    exact_match = REWARDS.get("exact_match")
    for sample in trained:
        answer = answers[sample["prompt"]]
        rule = exact_match(RewardInput(prompt=sample["prompt"], response=sample["response"], ground_truth=answer))
        assert sample["reward"] == pytest.approx(rule + 0.5, abs=1e-6), sample
    steps = [m for m in metrics if "reward/judge/mean" in m]
    assert [(m["reward/judge/mean"], m["reward/judge/failures"]) for m in steps] == [(1.0, 0.0), (1.0, 0.0)]


def test_the_constant_judge_writes_ones(tmp_path):
    """The test's judge does what its docstring says, through the HF engine (so the runs above test the
    reward's plumbing, not a judge that happens to say 1)."""
    from transformers import AutoTokenizer

    from megarlhf.rollout.engines.hf import HFEngine
    from megarlhf.rollout.engines.sampling import SamplingConfig

    path = make_constant_judge(tmp_path / "judge")
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(str(path), dtype=torch.float32, device="cpu", seed=0, max_model_len=64)
    prompts = [tokenizer("the answer is 4")["input_ids"], tokenizer("Score:")["input_ids"]]
    batch = engine.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_new_tokens=3))
    assert [tokenizer.decode(r) for r in batch.response_ids] == ["111", "111"]
