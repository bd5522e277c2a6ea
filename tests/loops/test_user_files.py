"""Nothing a user made is deleted or overwritten, through the command line as a user runs it (one process,
the tiny Qwen2 model): a run's ``config.yaml`` is written once, by its first successful start; a failed
command leaves it; a resume with another config keeps it and records its own beside it, naming the
changes, and its learning rate and schedule take effect; ``eval`` writes into a directory of its own with
every sample; ``export``, ``convert`` and a run's own final export refuse a directory megarlhf did not write, ``--overwrite`` or not; what megarlhf
writes for the user has the modes the umask gives.
"""
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarlhf.records.metrics import read_metrics

RECIPE = """
model: {path: MODEL, dtype: float32}
data: {train_path: DATA/sft_train.jsonl, eval_path: DATA/heldout.jsonl, chat_template: never,
       max_sequence_length: 256, max_prompt_length: 96}
rollout: {backend: hf, max_new_tokens: 8}
optim: {lr: 1.0e-3, use_distributed_optimizer: true}
train: {steps: 2, global_batch_size: 4, micro_batch_tokens: 512}
reward: {functions: [{name: exact_match}]}
eval: {max_prompts: 4}
checkpoint: {every: 2}
logging: {run_dir: RUN}
"""


def megarlhf_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """A command refused before it starts ranks, run in this process (a subprocess costs ~6 s of imports)."""
    from megarlhf import cli

    code = cli.main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def megarlhf(*args: str, umask: int = 0o022) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megarlhf", *args], capture_output=True, text=True, env=env,
                          timeout=600, preexec_fn=lambda: os.umask(umask))


def refused(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """The one error line of a refused command (warnings aside), checked to name every fragment."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("megarlhf: warning:")]
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def user_dir(path: Path) -> dict[str, str]:
    path.mkdir(parents=True)
    files = {"notes.txt": "mine", "model.safetensors": "not a model"}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


def intact(path: Path, files: dict[str, str]) -> bool:
    return {p.name: p.read_text() for p in path.iterdir()} == files


def modes(path: Path) -> set[int]:
    return {stat.S_IMODE(p.stat().st_mode) for p in path.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def trained(rl_assets, tmp_path_factory):
    """A 2-step SFT run (checkpoint at step 2) and the recipe that made it."""
    model, data = rl_assets
    root = tmp_path_factory.mktemp("user_files")
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE.replace("MODEL", str(model)).replace("DATA", str(data)).replace("RUN", str(root / "run")))
    done = megarlhf("sft", str(recipe))
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe, root / "run"


def test_the_run_record_is_written_once_and_a_changed_resume_is_recorded_beside_it(trained):
    recipe, run = trained
    record = (run / "config.yaml").read_text()
    assert yaml.safe_load(record)["train"]["steps"] == 2 and stat.S_IMODE((run / "config.yaml").stat().st_mode) == 0o644
    refused(megarlhf("sft", str(recipe), "data.train_path=typo.jsonl"), "typo.jsonl")
    refused(megarlhf("sft", str(recipe), "checkpoint.resume=/nowhere/step_9"), "/nowhere/step_9")
    assert (run / "config.yaml").read_text() == record  # failed starts leave the record alone

    resumed = megarlhf("sft", str(recipe), "train.steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.strip() == ""  # a resume prints nothing of the libraries' (their deprecations: the log)
    assert (run / "config.yaml").read_text() == record
    assert yaml.safe_load((run / "config.step-2.yaml").read_text())["train"]["steps"] == 3
    assert "differs from" in resumed.stdout and "train.steps: 2 -> 3" in resumed.stdout
    again = megarlhf("sft", str(recipe), "train.steps=3")  # the same config again: nothing new
    records = sorted(p.name for p in run.glob("config*"))
    assert again.returncode == 0 and records == ["config.step-2.yaml", "config.yaml"]


def test_eval_keeps_its_results_and_samples_in_a_directory_of_its_own(trained, capsys):
    recipe, run = trained
    record, metrics = (run / "config.yaml").read_text(), (run / "metrics.jsonl").read_text()
    done = megarlhf("eval", str(recipe), f"model.path={run / 'hf'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "config.yaml").read_text() == record and (run / "metrics.jsonl").read_text() == metrics
    [out] = (run / "eval").iterdir()
    printed = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert json.loads((out / "metrics.json").read_text()) == printed and printed["eval/prompts"] == 4
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all({"prompt", "response", "reward", "ground_truth"} <= s.keys() for s in samples)
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["path"] == str(run / "hf")
    mine = user_dir(run.parent / "mine")
    refused(megarlhf_here(capsys, "eval", str(recipe), f"model.path={run / 'hf'}", "--out", str(run.parent / "mine")),
            "not written by megarlhf")
    assert intact(run.parent / "mine", mine)


def test_exports_refuse_the_users_directories_and_get_the_umask_modes(trained, tmp_path, capsys):
    recipe, run = trained
    mine = user_dir(tmp_path / "mine")
    for extra in ([], ["--overwrite"]):
        refused(megarlhf_here(capsys, "export", str(run), "--out", str(tmp_path / "mine"), *extra),
                "not written by megarlhf")
        refused(megarlhf_here(capsys, "convert", "megatron-to-hf", "--ckpt", str(run / "checkpoints" / "step_2"),
                         "--out", str(tmp_path / "mine"), *extra), "not written by megarlhf")
    assert intact(tmp_path / "mine", mine)

    out = tmp_path / "exported"
    done = megarlhf("export", str(run), "--out", str(out), umask=0o027)  # the run directory, not a recipe
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "model.safetensors").read_bytes() == (run / "hf" / "model.safetensors").read_bytes()
    assert modes(out) == {0o640} and modes(run / "hf") == {0o644}
    refused(megarlhf_here(capsys, "export", str(run), "--out", str(out)), "already exists", "--overwrite")
    assert megarlhf("export", str(run), "--out", str(out), "--overwrite").returncode == 0


def test_a_run_whose_export_directory_is_the_users_is_refused_before_training(trained, tmp_path):
    recipe, _ = trained
    run = tmp_path / "run"
    mine = user_dir(run / "hf")
    refused(megarlhf("sft", str(recipe), f"logging.run_dir={run}"), str(run / "hf"), "not written by megarlhf")
    assert intact(run / "hf", mine) and not (run / "checkpoints").exists() and not (run / "config.yaml").exists()


@pytest.mark.slow  # six one-process runs (~1 min): make test-slow
@pytest.mark.parametrize("optimizer", ["distributed", "plain"])
def test_a_resume_with_another_learning_rate_and_length_trains_with_them(trained, tmp_path, optimizer):
    """The resumed steps' learning rate is the new schedule's (the one a fresh run with the new settings reaches
    there), not the checkpoint's. Before: Megatron's optimizers stopped, the distributed one with a bare
    KeyError, the plain one with a ValueError (both find saved parameter groups by their max_lr)."""
    recipe, _ = trained
    kind = f"optim.use_distributed_optimizer={optimizer == 'distributed'}"
    first = megarlhf("sft", str(recipe), f"logging.run_dir={tmp_path / 'resumed'}", kind)
    assert first.returncode == 0, first.stderr[-3000:]
    changed = ["optim.lr=5.0e-4", "train.steps=4", "optim.schedule=linear", kind]
    resumed = megarlhf("sft", str(recipe), f"logging.run_dir={tmp_path / 'resumed'}", *changed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout and "optim.lr: 0.001 -> 0.0005" in resumed.stdout
    fresh = megarlhf("sft", str(recipe), f"logging.run_dir={tmp_path / 'fresh'}", *changed)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    lr = {name: {r["step"]: r["sft/lr"] for r in read_metrics(tmp_path / name / "metrics.jsonl")}
          for name in ("resumed", "fresh")}
    assert lr["resumed"][2] == lr["fresh"][2] and lr["resumed"][3] == lr["fresh"][3]
    assert lr["fresh"][2] != lr["resumed"][0]  # (the old schedule's lr differs: the test can tell them apart)


def test_a_resume_with_the_other_kind_of_optimizer_is_refused_naming_the_key(trained):
    recipe, run = trained  # saved with the distributed optimizer
    refused(megarlhf("sft", str(recipe), "train.steps=5", "optim.use_distributed_optimizer=false"),
            "resume with optim.use_distributed_optimizer=true")


def test_rl_prompts_without_the_answers_the_reward_needs_are_refused_before_training(trained, rl_assets, tmp_path):
    recipe, _ = trained
    _, data = rl_assets
    refused(megarlhf("train", str(recipe), f"data.train_path={data / 'train.jsonl'}", "data.answer_key=solution",
                     f"logging.run_dir={tmp_path / 'run'}"),
            "prompts have no 'solution' field", "which the reward exact_match scores against")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_run_of_another_command_in_the_run_directory_is_refused_naming_both(trained, tmp_path):
    """Before: `megarlhf dpo` on an SFT run's directory tried to resume its checkpoint and failed with an
    unrelated message."""
    recipe, run = trained
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i}"}) + "\n"
                             for i in range(8)))
    refused(megarlhf("dpo", str(recipe), f"data.train_path={pairs}", "data.eval_path=null"),
            "holds the state of a `megarlhf sft` run and this is a `megarlhf dpo` run", "model.path=")
