"""RLHF on a CPU machine: preference pairs -> reward model -> GRPO against it, and DPO on the same pairs.

1. the task and SFT model of examples/demo.py (worked solutions, then answer-first instruction data), or
   those of an earlier ``demo.py`` run (``--from runs/demo``);
2. synthetic preference pairs on the task's problems with a known ground truth: the correct worked
   solution is preferred over a wrong answer (a slip in the working, a wrong final line, no answer
   line, or a wrong guess stated first) -- ``megarlhf.data.synthetic.write_preference_task``;
3. a reward model (``megarlhf rm``): a value head on the SFT model, Bradley-Terry loss; held-out pair
   accuracy reported;
4. GRPO (``megarlhf train``) from the SFT model with the learned reward as its only reward (standardised
   with the statistics ``megarlhf rm`` stored), held-out accuracy measured by the exact-match verifier;
5. DPO (``megarlhf dpo``) from the same SFT model on the same pairs;
6. prints the held-out task accuracy of SFT, GRPO-vs-RM and DPO side by side and writes
   ``preference_curves.png`` (reward-model accuracy, GRPO's learned reward and held-out accuracy, DPO's
   implicit-reward accuracy) beside each run's own curves.

    python examples/preference_demo.py [--out runs/preference_demo] [--from runs/demo]
"""
import argparse
import json
import time
from pathlib import Path

from demo import make_task_and_model, megarlhf, held_out_accuracy, TASK

PAIRS = dict(n_train=2000, n_heldout=200)


def supervised_model(out: Path, previous: Path | None, nproc: int) -> tuple[Path, dict[str, Path]]:
    """The answer-first SFT model and the task's data: an earlier demo.py run's, or made here as it does."""
    if previous is not None:
        model, data = previous / "sft_answer_first" / "hf", previous / "data"
        if not (model / "config.json").is_file():
            raise FileNotFoundError(f"--from {previous}: no SFT export at {model} (run examples/demo.py first)")
        return model, {"train": data / "train.jsonl", "heldout": data / "heldout.jsonl"}
    base, data = make_task_and_model(out)
    megarlhf("sft", "demo_sft.yaml", [f"model.path={base}", f"data.train_path={data['sft_train']}",
                                      f"logging.run_dir={out / 'sft'}", "checkpoint.resume=none"], nproc)
    megarlhf("sft", "demo_sft_answer_first.yaml",
             [f"model.path={out / 'sft' / 'hf'}", f"data.train_path={data['sft_answer_first']}",
              f"logging.run_dir={out / 'sft_answer_first'}", "checkpoint.resume=none"], nproc)
    return out / "sft_answer_first" / "hf", data


def last(metrics_path: Path, key: str) -> float:
    from megarlhf.records.metrics import read_metrics

    values = [r[key] for r in read_metrics(metrics_path) if r.get(key) is not None]
    if not values:
        raise RuntimeError(f"{metrics_path} recorded no {key}")
    return values[-1]


def plot_summary(out: Path) -> Path:
    """One figure of the three runs' curves (steps on x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megarlhf.records.metrics import read_metrics

    panels = [("reward model: pair accuracy", "rm", ["rm/accuracy", "eval/rm/accuracy"]),
              ("GRPO: learned reward (std. units)", "grpo_rm", ["reward/mean"]),
              ("GRPO: held-out accuracy (verifier)", "grpo_rm", ["eval/accuracy"]),
              ("DPO: implicit-reward accuracy", "dpo", ["rewards/accuracy", "eval/rewards/accuracy"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5))
    for ax, (title, run, keys) in zip(axes, panels):
        records = read_metrics(out / run / "metrics.jsonl")
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 15 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "preference_curves.png", dpi=100)
    plt.close(fig)
    return out / "preference_curves.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/preference_demo")
    parser.add_argument("--from", dest="previous", default=None, help="reuse this demo.py output's SFT model")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    from megarlhf.data.synthetic import write_preference_task

    start = time.time()
    out = Path(args.out).absolute()
    sft, data = supervised_model(out, Path(args.previous).absolute() if args.previous else None, args.nproc)
    pairs = write_preference_task(out / "pairs", seed=0, **PAIRS, **TASK)
    print(f"[preference demo] SFT model {sft}; {PAIRS['n_train']} training pairs ({time.time() - start:.0f} s)",
          flush=True)
    on_pairs = [f"data.train_path={pairs['pairs_train']}", f"data.eval_path={pairs['pairs_heldout']}",
                "checkpoint.resume=none"]
    megarlhf("rm", "demo_rm.yaml", [f"model.path={sft}", f"logging.run_dir={out / 'rm'}", *on_pairs], args.nproc)
    rm_accuracy = last(out / "rm" / "metrics.jsonl", "eval/rm/accuracy")
    print(f"[preference demo] reward model: held-out pair accuracy {100 * rm_accuracy:.1f} % "
          f"({time.time() - start:.0f} s)", flush=True)
    megarlhf("train", "demo_grpo_learned_reward.yaml",
             [f"model.path={sft}", f"reward.reward_model_path={out / 'rm' / 'hf'}", f"data.train_path={data['train']}",
              f"data.eval_path={data['heldout']}", f"logging.run_dir={out / 'grpo_rm'}", "checkpoint.resume=none"],
             args.nproc)
    print(f"[preference demo] GRPO against the reward model done ({time.time() - start:.0f} s)", flush=True)
    megarlhf("dpo", "demo_dpo.yaml", [f"model.path={sft}", f"logging.run_dir={out / 'dpo'}", *on_pairs], args.nproc)
    dpo = held_out_accuracy(out / "dpo" / "hf", data, args.nproc)

    from megarlhf.records.metrics import read_metrics

    evals = [r for r in read_metrics(out / "grpo_rm" / "metrics.jsonl") if r.get("eval/accuracy") is not None]
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    table = {"sft": before, "grpo_vs_reward_model": after, "dpo": dpo, "reward_model_pair_accuracy": rm_accuracy,
             "heldout_problems": int(evals[0]["eval/prompts"]), "wall_s": round(time.time() - start)}
    (out / "summary.json").write_text(json.dumps(table, indent=1) + "\n")
    print(f"\n[preference demo] held-out task accuracy ({table['heldout_problems']} problems, greedy, "
          f"exact-match verifier):")
    print(f"         SFT (the start of both)            {100 * before:5.1f} %")
    print(f"         GRPO against the reward model      {100 * after:5.1f} %   ({100 * (after - before):+.1f} points)")
    print(f"         DPO on the same pairs              {100 * dpo:5.1f} %   ({100 * (dpo - before):+.1f} points)")
    print(f"[preference demo] reward model held-out pair accuracy {100 * rm_accuracy:.1f} %")
    print(f"[preference demo] curves: {plot_summary(out)}; runs under {out}")
    print(f"[preference demo] total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
