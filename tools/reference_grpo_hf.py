"""A plain transformers + torch GRPO loop, written without megarlhf, to cross-check its learning curves.

Same algorithm as ``examples/recipes/demo_grpo.yaml``: per step, ``--prompts`` training prompts x
``--samples`` responses sampled with ``generate`` at ``--temperature``; exact-match reward on "The answer
is N"; group-normalised advantages (r - mean) / std; one AdamW update per step on the token-mean
policy-gradient loss (the PPO ratio is 1 with one update per step); gradient clipping at 1.0. Held-out
greedy accuracy every 10 steps. Single process, no packing, no vLLM: slow, but independent.

    .venv/bin/python tools/reference_grpo_hf.py runs/demo/sft/hf runs/demo/data --steps 20 --lr 1e-4
"""
import argparse
import json
import random
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def reward(text: str, answer: str) -> float:
    match = re.search(r"The answer is (-?\d+)", text)
    return float(bool(match and match.group(1) == answer))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("data_dir", help="holds train.jsonl and heldout.jsonl (prompt, answer)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    data = Path(args.data_dir)
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (data / "heldout.jsonl").read_text().splitlines()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def generate(prompts: list[str], n: int, sample: bool):
        enc = tok([p for p in prompts for _ in range(n)], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=sample, top_p=1.0,
                                 temperature=args.temperature if sample else None, pad_token_id=tok.eos_token_id)
        return enc, out

    def accuracy() -> float:
        model.eval()
        correct = 0
        for i in range(0, len(heldout), 50):
            rows = heldout[i:i + 50]
            enc, out = generate([r["prompt"] for r in rows], 1, sample=False)
            texts = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
            correct += sum(reward(t, r["answer"]) for t, r in zip(texts, rows))
        return correct / len(heldout)

    rng = random.Random(0)
    print(f"step 0: held-out accuracy {accuracy():.3f}", flush=True)
    for step in range(args.steps):
        rows = rng.sample(train, args.prompts)
        enc, out = generate([r["prompt"] for r in rows], args.samples, sample=True)
        prompt_len = enc.input_ids.shape[1]
        responses = out[:, prompt_len:]
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        rewards = torch.tensor([reward(t, rows[i // args.samples]["answer"]) for i, t in enumerate(texts)])
        grouped = rewards.view(args.prompts, args.samples)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        is_eos = responses == tok.eos_token_id
        no_eos = torch.full((responses.shape[0],), responses.shape[1] - 1)
        last = torch.where(is_eos.any(1), is_eos.float().argmax(1), no_eos)
        mask = (torch.arange(responses.shape[1])[None] <= last[:, None]).float()  # response tokens up to EOS
        attention = torch.cat([enc.attention_mask, torch.ones_like(responses)], dim=1)
        model.train()
        logits = model(input_ids=out, attention_mask=attention).logits[:, prompt_len - 1:-1].float()
        logprobs = torch.log_softmax(logits / args.temperature, -1).gather(-1, responses[..., None])[..., 0]
        loss = -(advantages[:, None] * logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        print(f"step {step + 1}: reward/mean {rewards.mean():.3f}  grad_norm {grad_norm:.3f}", flush=True)
        if (step + 1) % 10 == 0:
            print(f"step {step + 1}: held-out accuracy {accuracy():.3f}", flush=True)


if __name__ == "__main__":
    main()
