"""Tool use on a CPU machine: GRPO teaches a tiny model to call a calculator in multi-turn rollouts.

1. writes two-digit sums ("What is 47 + 89?"), training and held-out problems that share none;
2. makes a tiny Llama-architecture model whose tokenizer has ``<tool_call>`` / ``</tool_call>`` as
   single tokens (as Qwen2.5's has), trained on the task's texts;
3. SFT (``megarlhf sft``) on responses of which 30% call the calculator (the call, the tool's answer,
   the final answer) and 70% state an answer directly: greedy decoding then answers directly, and a
   3M-parameter model gets few two-digit sums right that way;
4. GRPO (``megarlhf train`` with ``rollout.env: calculator``): samples that call the tool get the
   right number back and the reward; held-out accuracy and the tool-call rate (greedy, multi-turn) are
   measured before the first update and every 10 steps;
5. prints accuracy and call rate after SFT and after GRPO.

    python examples/tool_demo.py [--out runs/tool_demo]
"""
import argparse
import json
import time
from pathlib import Path

from demo import MODEL, megarlhf

TASK = dict(max_steps=1, max_value=99, ops=("add",), style="bare", instruction=None)
TOOL_TOKENS = ("<tool_call>", "</tool_call>")


def make_task_and_model(out: Path) -> tuple[Path, dict[str, Path]]:
    from megarlhf.data.synthetic import write_arithmetic_task
    from model_providers.tiny_models import make_tiny_model

    data = write_arithmetic_task(out / "data", n_train=4000, n_heldout=200, seed=0, sft_tool_call_fraction=0.3,
                                 **TASK)
    rows = [json.loads(line) for line in Path(data["sft_train"]).read_text().splitlines()]
    corpus = [text for row in rows for text in (row["prompt"], row["response"])]
    base = make_tiny_model("llama", out / "base", seed=0, tokenizer_corpus=corpus, tokenizer_vocab_size=640,
                           added_tokens=TOOL_TOKENS, **{**MODEL, "vocab_size": 648})
    return base, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/tool_demo")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    from megarlhf.records.metrics import read_metrics

    start = time.time()
    out = Path(args.out).absolute()
    base, data = make_task_and_model(out)
    megarlhf("sft", "demo_sft_calculator.yaml", [f"model.path={base}", f"data.train_path={data['sft_train']}",
                                                 f"logging.run_dir={out / 'sft'}", "checkpoint.resume=none"], args.nproc)
    print(f"[tool demo] SFT done ({time.time() - start:.0f} s)", flush=True)
    megarlhf("train", "demo_grpo_calculator.yaml",
             [f"model.path={out / 'sft' / 'hf'}", f"data.train_path={data['train']}",
              f"data.eval_path={data['heldout']}", f"logging.run_dir={out / 'grpo'}", "checkpoint.resume=none"],
             args.nproc)
    evals = [r for r in read_metrics(out / "grpo" / "metrics.jsonl") if r.get("eval/accuracy") is not None]
    summary = {"steps": [r["step"] for r in evals], "accuracy": [r["eval/accuracy"] for r in evals],
               "tool_call_rate": [r["eval/tools/call_rate"] for r in evals], "wall_s": round(time.time() - start)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n[tool demo] held-out ({int(evals[0]['eval/prompts'])} two-digit sums, greedy, multi-turn):")
    print("         step   accuracy   calls the calculator")
    for r in evals:
        print(f"         {r['step']:4d}   {100 * r['eval/accuracy']:6.1f} %   {100 * r['eval/tools/call_rate']:6.1f} %")
    print(f"[tool demo] curves: {out / 'grpo' / 'curves.png'}; total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
