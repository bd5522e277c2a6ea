#!/usr/bin/env python
"""A newcomer's session, scripted: the README's commands as written, and the mistakes newcomers make.

    python tools/newcomer_session.py --list               # every command of the README, numbered
    python tools/newcomer_session.py --run 3,4,35          # those, verbatim, from the repository root
    python tools/newcomer_session.py --bad-inputs          # the mistakes, in a scratch directory

``--run`` executes the README's lines exactly as a reader pastes them (continuation lines joined); a command
holding a placeholder (``HF_DIR``, ``RECIPE.yaml``, ``...``) is reported and skipped: it cannot run as
written. The training commands run for as long as the README says they do.

``--bad-inputs`` makes a tiny model and task, then runs each mistake through ``python -m megarlhf``: a
typo'd data path, an unknown key, a removed key, a hub name, a wrong type, a missing recipe, a broken YAML,
an unknown backend or reward, a checkpoint to resume that is not there, prompts without the answers their
reward needs, a prompt + response budget beyond the model's positions, an export / convert / fetch into a directory of the user's files, an eval whose recipe names a
run directory, a dpo run in an sft run's directory. Every one must exit non-zero with exactly one line on
stderr that starts with ``megarlhf`` and holds no traceback (the eval must succeed and leave the run's
``config.yaml`` as it was), and the user's directory must keep its file. Prints one row per case; exits 1 if
any fails.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9]*_(DIR|OUT|PATH)\b|RECIPE\.yaml|\.\.\.|\bX\b")
USER_FILE = "my-notes.txt"


def readme_commands(readme: Path = ROOT / "README.md") -> list[str]:
    """The shell commands of the README's fenced blocks that run megarlhf or make (continuations joined)."""
    commands, inside, pending = [], False, ""
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        text = pending + line.split("  #")[0].rstrip() if pending else line.split("  #")[0].rstrip()
        if text.endswith("\\"):
            pending = text[:-1].rstrip() + " "
            continue
        pending = ""
        if text.startswith((".venv/bin/python", "make ")):
            commands.append(" ".join(text.split()))
    return commands


def run_readme(numbers: list[int]) -> int:
    commands, failed = readme_commands(), 0
    for number in numbers:
        command = commands[number]
        if PLACEHOLDER.search(command):
            print(f"[{number}] skipped (a placeholder to fill in): {command}")
            continue
        start = time.perf_counter()
        proc = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True)
        lines = proc.stderr.strip().splitlines()
        print(f"[{number}] exit {proc.returncode} in {time.perf_counter() - start:.0f} s, {len(lines)} stderr "
              f"line(s): {command}")
        failed += proc.returncode != 0
    return int(failed > 0)


def _megarlhf(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarlhf", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                                "PATH": "/usr/bin:/bin", "HOME": str(cwd)})


def _one_clear_line(proc: subprocess.CompletedProcess, expect: str) -> str | None:
    """Why ``proc`` is not one clear error line containing ``expect`` (None: it is)."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if proc.returncode == 0:
        return "exited 0"
    if len(lines) != 1 or not lines[0].startswith("megarlhf") or "Traceback" in proc.stderr:
        return f"{len(lines)} stderr lines: {proc.stderr[-400:]!r}"
    if expect.lower() not in lines[0].lower():
        return f"the line does not mention {expect!r}: {lines[0]!r}"
    return None


def _scratch(work: Path) -> dict[str, Path]:
    """A tiny model, a task, a user's directory, and a finished tiny SFT run (its run directory)."""
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch", "qwen2", "--out",
                    str(work / "model")], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "megarlhf.data.synthetic", str(work / "data"), "--n-train", "32",
                    "--n-heldout", "8", "--max-steps", "1"], check=True, capture_output=True, cwd=ROOT)
    (work / "user").mkdir()
    (work / "user" / USER_FILE).write_text("mine\n")
    no_answer = work / "data" / "no_answer.jsonl"
    no_answer.write_text("".join(json.dumps({"prompt": row["prompt"]}) + "\n" for row in
                                 map(json.loads, (work / "data" / "train.jsonl").read_text().splitlines())))
    pairs = work / "data" / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": row["prompt"], "chosen": row["answer"], "rejected": "no"}) + "\n"
                             for row in map(json.loads, (work / "data" / "train.jsonl").read_text().splitlines())))
    recipe = work / "recipe.yaml"
    recipe.write_text(f"""model: {{path: {work / 'model'}, dtype: float32}}
data: {{train_path: {work / 'data' / 'train.jsonl'}, eval_path: {work / 'data' / 'heldout.jsonl'},
       max_prompt_length: 240, max_sequence_length: 256, chat_template: never}}
rollout: {{n_samples: 2, max_new_tokens: 8, kv_cache_mb: 64, backend: fake}}
train: {{steps: 1, global_batch_size: 4, micro_batch_tokens: 512}}
reward: {{functions: [{{name: exact_match}}]}}
eval: {{every: 0, max_prompts: 4}}
checkpoint: {{every: 1}}
logging: {{run_dir: {work / 'sft-run'}, backends: []}}
""")
    (work / "broken.yaml").write_text("model: {path: [unclosed\n")
    done = _megarlhf(["sft", str(recipe), f"data.train_path={work / 'data' / 'sft_train.jsonl'}"], work)
    if done.returncode != 0:
        raise RuntimeError(f"the scratch SFT run failed: {done.stderr[-2000:]}")
    return {"recipe": recipe, "run": work / "sft-run", "user": work / "user", "no_answer": no_answer, "pairs": pairs,
            "broken": work / "broken.yaml", "model": work / "model"}


def bad_inputs(work: Path) -> list[tuple[str, list[str], str]]:
    """(case, arguments, what its one line must mention)."""
    s = _scratch(work)
    recipe, user = str(s["recipe"]), str(s["user"])
    return [
        ("typo'd data path", ["train", recipe, "data.train_path=data/nope.jsonl"], "nope.jsonl"),
        ("unknown key", ["train", recipe, "train.stepz=3"], "stepz"),
        ("removed key", ["train", recipe, "logging.tensorboard=true"], "logging.backends"),
        ("hub name as model.path", ["train", recipe, "model.path=Qwen/Qwen2.5-0.5B-Instruct"], "hub"),
        ("wrong type", ["train", recipe, "train.steps=many"], "train.steps"),
        ("missing recipe", ["train", str(work / "nope.yaml")], "nope.yaml"),
        ("broken YAML", ["train", str(s["broken"])], "broken.yaml"),
        ("unknown rollout backend", ["train", recipe, "rollout.backend=sglang"], "sglang"),
        ("unknown reward", ["train", recipe, "reward.functions=[{name: exactmatch}]"], "exactmatch"),
        ("resume from nothing", ["train", recipe, "checkpoint.resume=never"], "never"),
        ("prompts without answers", ["train", recipe, f"data.train_path={s['no_answer']}",
                                     f"logging.run_dir={work / 'rl-run'}"], "answer"),
        ("bad model path on 2 ranks", ["sft", recipe, "model.path=/nonexistent/model", "--nproc-per-node", "2"],
         "/nonexistent/model"),
        ("export into the user's directory", ["export", str(s["run"]), "--out", user], user),
        ("export into it with --overwrite", ["export", str(s["run"]), "--out", user, "--overwrite"], user),
        ("convert into the user's directory", ["convert", "megatron-to-hf", "--ckpt",
                                               str(s["run"] / "checkpoints" / "step_1"), "--out", user,
                                               "--hf-config", str(s["model"])], user),
        ("fetch into the user's directory", ["fetch", "smollm2-135m-instruct", "--out", user], user),
        ("dpo in an sft run's directory", ["dpo", recipe, f"data.train_path={s['pairs']}",
                                           f"data.eval_path={s['pairs']}"], "sft"),
        ("prompt + response beyond the model's positions", ["train", recipe, "rollout.max_new_tokens=100",
                                                             f"logging.run_dir={work / 'rl-run'}"],
         "max_position_embeddings"),
    ]


def check_bad_inputs(work: Path) -> int:
    cases, failures = bad_inputs(work), 0
    for name, args, expect in cases:
        start = time.perf_counter()
        problem = _one_clear_line(_megarlhf(args, work), expect)
        if not (work / "user" / USER_FILE).is_file():
            problem = (problem + "; " if problem else "") + "the user's file is gone"
        failures += problem is not None
        print(f"{'FAIL' if problem else 'ok  '} {name} ({time.perf_counter() - start:.0f} s)"
              + (f": {problem}" if problem else ""), flush=True)
    record = (work / "sft-run" / "config.yaml").read_text()
    proc = _megarlhf(["eval", str(work / "recipe.yaml"), "eval.max_prompts=4"], work)
    kept = (work / "sft-run" / "config.yaml").read_text() == record and any((work / "sft-run" / "eval").iterdir())
    print(f"{'ok  ' if proc.returncode == 0 and kept else 'FAIL'} eval whose recipe names a run directory "
          f"(exit {proc.returncode}; config.yaml kept and results in eval/: {kept})", flush=True)
    failures += not (proc.returncode == 0 and kept)
    print(f"{len(cases) + 1 - failures} of {len(cases) + 1} cases behave")
    return int(failures > 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the README's commands, numbered")
    parser.add_argument("--run", help="comma-separated numbers (from --list) to run verbatim")
    parser.add_argument("--bad-inputs", action="store_true", help="run the newcomer mistakes")
    parser.add_argument("--work", help="scratch directory for --bad-inputs (default: a new temporary one)")
    args = parser.parse_args(argv)
    if args.list:
        for number, command in enumerate(readme_commands()):
            print(f"[{number}]{' (placeholder)' if PLACEHOLDER.search(command) else ''} {command}")
    status = run_readme([int(n) for n in args.run.split(",")]) if args.run else 0
    if args.bad_inputs:
        work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="megarlhf-newcomer-"))
        try:
            status |= check_bad_inputs(work)
        finally:
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
