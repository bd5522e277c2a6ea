"""The main job on a CPU machine: SFT warm start, then GRPO with vLLM rollouts and Megatron training.

1. writes a synthetic verifiable task: arithmetic word problems with numeric answers, a training split
   and a held-out split that share no problem (megarlhf.data.synthetic);
2. makes a tiny Llama-architecture model from scratch (random weights, a BPE tokenizer trained on the
   task's training texts);
3. SFT in two stages (``megarlhf sft``, 2 ranks, data parallel): first on worked solutions (the
   working, then "The answer is N."), which teaches the model to solve the problems; then a short pass
   over instruction data where 70% of responses state the answer first and justify it after, as terse
   instruction data often does. Greedy decoding now mostly answers before computing;
4. GRPO (``megarlhf train``, 2 ranks: Megatron-Core trainer + one vLLM engine per rank, colocated)
   from the second stage, rewarded by exact match of the stated answer, evaluating held-out accuracy
   before the first update (= after SFT), every 10 steps and at the end;
5. prints held-out accuracy after each SFT stage and after GRPO; leaves curves, TensorBoard events,
   metrics.jsonl and the HF export of the trained model under the output directory.

    python examples/demo.py [--out runs/demo] [--grpo-steps N] [--sft-steps N]
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RECIPES = Path(__file__).with_name("recipes")
TASK = dict(max_steps=2, max_value=15, ops=("add", "sub"), instruction=None)
ANSWER_FIRST_FRACTION = 0.7  # of the second SFT stage's responses
# Llama architecture: transformers loads its tokenizer with the split it was trained with, so numbers up
# to ~40 are single tokens (a Qwen2 directory is re-tokenized digit by digit, which makes the sums harder
# for a 3M-parameter model and the sequences ~1.5x longer).
ARCH = "llama"
MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=768, max_position_embeddings=256, vocab_size=640, tie_word_embeddings=True,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0))


def megarlhf_command(command: str, recipe: str, overrides: list[str], nproc: int) -> list[str]:
    """``torchrun -m megarlhf COMMAND examples/recipes/RECIPE overrides`` on ``nproc`` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
            "-m", "megarlhf", command, str(RECIPES / recipe), *overrides]


QUIET = {"PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
         "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def megarlhf(command: str, recipe: str, overrides: list[str], nproc: int) -> None:
    """Runs ``megarlhf COMMAND RECIPE overrides`` on ``nproc`` local ranks."""
    subprocess.run(megarlhf_command(command, recipe, overrides, nproc), check=True, env={**os.environ, **QUIET})


def make_task_and_model(out: Path, arch: str = ARCH, model: dict = MODEL) -> tuple[Path, dict[str, Path]]:
    """The task's JSONL files under ``out/data`` (plus ``sft_answer_first``: the same SFT problems with
    answer-first responses mixed in) and a random ``arch`` model under ``out/base`` whose tokenizer is
    trained on the worked-solution SFT texts; returns (model directory, data paths)."""
    from megarlhf.data.synthetic import write_arithmetic_task
    from model_providers.tiny_models import make_tiny_model

    data = write_arithmetic_task(out / "data", n_train=4000, n_heldout=200, seed=0, **TASK)
    data["sft_answer_first"] = write_arithmetic_task(
        out / "data" / "answer_first", n_train=4000, n_heldout=200, seed=0,
        sft_answer_first_fraction=ANSWER_FIRST_FRACTION, **TASK)["sft_train"]
    rows = [json.loads(line) for line in Path(data["sft_train"]).read_text().splitlines()]
    corpus = [text for row in rows for text in (row["prompt"], row["response"])]
    base = make_tiny_model(arch, out / "base", seed=0, tokenizer_corpus=corpus, tokenizer_vocab_size=640, **model)
    return base, data


def held_out_accuracy(model_dir: Path, data: dict[str, Path], nproc: int) -> float:
    """Greedy held-out accuracy of an HF model directory (``megarlhf eval`` with the GRPO recipe)."""
    command = megarlhf_command("eval", "demo_grpo.yaml", [f"model.path={model_dir}",
                                                          f"data.eval_path={data['heldout']}"], nproc)
    done = subprocess.run(command, check=True, env={**os.environ, **QUIET}, stdout=subprocess.PIPE, text=True)
    results = [line for line in done.stdout.splitlines() if line.startswith("{") and '"eval/accuracy"' in line]
    if not results:
        raise RuntimeError(f"megarlhf eval printed no metrics line; its output:\n{done.stdout[-2000:]}")
    return json.loads(results[-1])["eval/accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=None, help="override the SFT recipe's train.steps")
    parser.add_argument("--grpo-steps", type=int, default=None, help="override the GRPO recipe's train.steps")
    args = parser.parse_args()

    from megarlhf.records.metrics import read_metrics

    start = time.time()
    out = Path(args.out).absolute()
    base, data = make_task_and_model(out)
    print(f"[demo] task and model ready ({time.time() - start:.0f} s)", flush=True)

    sft = [f"model.path={base}", f"data.train_path={data['sft_train']}", f"logging.run_dir={out / 'sft'}",
           "checkpoint.resume=none"] + ([f"train.steps={args.sft_steps}"] if args.sft_steps else [])
    megarlhf("sft", "demo_sft.yaml", sft, args.nproc)
    worked = held_out_accuracy(out / "sft" / "hf", data, args.nproc)
    print(f"[demo] SFT on worked solutions done, held-out accuracy {100 * worked:.1f} % "
          f"({time.time() - start:.0f} s)", flush=True)
    answer_first = [f"model.path={out / 'sft' / 'hf'}", f"data.train_path={data['sft_answer_first']}",
                    f"logging.run_dir={out / 'sft_answer_first'}", "checkpoint.resume=none"]
    megarlhf("sft", "demo_sft_answer_first.yaml", answer_first, args.nproc)
    print(f"[demo] SFT on answer-first data done ({time.time() - start:.0f} s)", flush=True)

    grpo = [f"model.path={out / 'sft_answer_first' / 'hf'}", f"data.train_path={data['train']}",
            f"data.eval_path={data['heldout']}", f"logging.run_dir={out / 'grpo'}", "checkpoint.resume=none"]
    grpo += [f"train.steps={args.grpo_steps}"] if args.grpo_steps else []
    megarlhf("train", "demo_grpo.yaml", grpo, args.nproc)

    evals = [r for r in read_metrics(out / "grpo" / "metrics.jsonl") if r.get("eval/accuracy") is not None]
    after_sft, after_grpo = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    print(f"\n[demo] held-out accuracy ({int(evals[0]['eval/prompts'])} problems, greedy):")
    print(f"         after SFT on worked solutions      {100 * worked:5.1f} %")
    print(f"         after SFT on answer-first data     {100 * after_sft:5.1f} %   (GRPO starts here)")
    print(f"         after GRPO                         {100 * after_grpo:5.1f} %   "
          f"({100 * (after_grpo - after_sft):+.1f} points over its start)")
    print(f"[demo] curves: {out / 'grpo' / 'curves.png'}; metrics: {out / 'grpo' / 'metrics.jsonl'}; "
          f"trained model (HF): {out / 'grpo' / 'hf'}")
    print(f"[demo] total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
