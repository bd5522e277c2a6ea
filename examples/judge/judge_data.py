"""Data for training an LLM judge, and how far a judge agrees with a verifier.

Both subcommands read a recipe with a ``reward.judge`` section (its template, pattern and judge) and sample
responses from the recipe's policy (``model.path``) to prompts of a JSONL file, one per prompt at T=1 with the
recipe's chat template and response budget. Each sampled response comes twice: as sampled, and *edited*, its
stated answer ("The answer is N", or the end of a response that never stated one) replaced by the reference
when it was wrong and by another number when it was right. So the pairs differ only where a grader must look,
and about half of the responses are correct whatever the policy's accuracy (the edit needs numeric answers).
The recipe's verifier (the first of ``eval.reward_functions``, else of ``reward.functions``: e.g. math_verify)
labels every response.

``sft-data``   writes SFT rows for the judge: ``{"prompt": the judge's message (the template with each value
               quoted, exactly as the judge will read it), "response": "Score: 1" or "Score: 0"}``;
``agreement``  judges the responses with the recipe's judge (``megarlhf.rollout.judge``, as a run does) and
               prints how often its verdict (score > 0.5) equals the verifier's, its failures and its speed.

Example (the README's "LLM judges" section)::

    python examples/judge/judge_data.py sft-data examples/recipes/smollm2_grpo_judge.yaml \\
        --prompts data/smollm2_sums/train.jsonl --n 600 --out data/smollm2_judge/sft_train.jsonl
    python examples/judge/judge_data.py agreement examples/recipes/smollm2_grpo_judge.yaml \\
        --prompts data/smollm2_sums/heldout.jsonl --n 200
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import types
from pathlib import Path

import torch

from megarlhf.config import RunConfig, load_config
from megarlhf.data.prompts import load_prompt_dataset
from megarlhf.rewards.api import RewardInput, resolve_reward
from megarlhf.rewards.judging import JudgePrompts, judge_fields
from megarlhf.rollout.engines.hf import HFEngine
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.loops import rewarding
from megarlhf.rollout.judge import EngineJudge

STATED = re.compile(r"(The answer is:?\s*)(-?\d+(?:\.\d+)?)")


def edited(response: str, reference: str, right: bool, rng: random.Random) -> str:
    """``response`` with its stated answer made wrong (``right``) or right (otherwise)."""
    wrong = str(int(float(reference)) + rng.choice([-10, -2, -1, 1, 2, 10]))
    target = wrong if right else reference
    matches = list(STATED.finditer(response))
    if not matches:
        return response.rstrip() + f" The answer is {target}."
    last = matches[-1]
    return response[:last.start(2)] + target + response[last.end(2):]


def sampled_responses(config: RunConfig, prompts_path: str, n: int, seed: int) -> list[tuple[RewardInput, float]]:
    """``2 n`` responses (each sampled one and its edit) with the verifier's reward."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    examples = load_prompt_dataset(prompts_path, tokenizer, config.data).examples[:n]
    engine = HFEngine(config.model.path, dtype=torch.float32, device="cpu", seed=seed,
                      max_model_len=config.data.max_prompt_length + config.rollout.max_new_tokens)
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=config.rollout.max_new_tokens,
                              stop_token_ids=(tokenizer.eos_token_id,), seed=seed)
    batch = engine.generate([e.prompt_ids for e in examples], sampling)
    verifier = resolve_reward(verifier_name(config))
    rng, out = random.Random(seed), []
    for p, ids in zip(batch.prompt_index, batch.response_ids):
        example = examples[p]
        question = rewarding.question(example)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        first = RewardInput(prompt=example.prompt, question=question, response=text,
                            ground_truth=example.ground_truth)
        right = verifier(first) > 0.5
        second = RewardInput(prompt=example.prompt, question=question, ground_truth=example.ground_truth,
                             response=edited(text, str(example.ground_truth), right, rng))
        out += [(first, float(right)), (second, float(verifier(second) > 0.5))]
    return out


def verifier_name(config: RunConfig) -> str:
    """The recipe's verifier: its first evaluation reward (``eval.reward_functions``, else ``reward.functions``)."""
    return config.eval_reward.functions[0].name


def sft_data(config: RunConfig, args) -> None:
    from transformers import AutoTokenizer

    # the judge is trained from the policy's model: its tokenizer
    prompts = JudgePrompts(config.reward.judge, AutoTokenizer.from_pretrained(config.model.path))
    rows = [{"prompt": prompts.message(judge_fields(sample)),
             "response": f"Score: {int(label)}"}
            for sample, label in sampled_responses(config, args.prompts, args.n, args.seed)]
    random.Random(args.seed).shuffle(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    correct = sum(r["response"] == "Score: 1" for r in rows)
    print(f"wrote {len(rows)} rows to {args.out}: {correct} correct responses, {len(rows) - correct} wrong")


def agreement(config: RunConfig, args) -> None:
    samples = sampled_responses(config, args.prompts, args.n, args.seed)
    runtime = types.SimpleNamespace(replica=types.SimpleNamespace(size=1, rank=0), device=torch.device("cpu"),
                                    all_gather_objects=lambda obj, over: [obj])
    judge = EngineJudge.build(config, runtime)
    start = time.perf_counter()
    verdicts = judge([s for s, _ in samples])
    seconds = time.perf_counter() - start
    scored = [(v > 0.5, label > 0.5) for v, (_, label) in zip(verdicts, samples) if isinstance(v, float)]
    failures = len(samples) - len(scored)
    agree = sum(v == t for v, t in scored)
    print(f"judge {config.reward.judge.model_path} on {len(samples)} responses ({sum(t for _, t in scored)} of the "
          f"scored ones correct by {verifier_name(config)}):")
    print(f"  agreement {agree}/{len(scored)} = {agree / max(len(scored), 1):.1%} of the scored; "
          f"failures (no score) {failures}")
    says_right = [v for v, t in scored if t], [v for v, t in scored if not t]
    print(f"  says correct on correct {sum(says_right[0])}, on wrong {sum(says_right[1])}")
    print(f"  {seconds:.1f} s, {seconds / len(samples) * 1000:.0f} ms per response")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("sft-data", "agreement"))
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--prompts", required=True, help="JSONL prompts with answers")
    parser.add_argument("--n", type=int, default=200, help="prompts (each gives two responses)")
    parser.add_argument("--out", help="sft-data: the JSONL file to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = load_config(RunConfig, args.recipe, args.overrides)
    if config.reward.judge is None or config.eval_reward is None:
        parser.error("the recipe needs reward.judge and a verifier (eval.reward_functions or reward.functions)")
    torch.manual_seed(args.seed)
    (sft_data if args.command == "sft-data" else agreement)(config, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
