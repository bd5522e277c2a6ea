"""GRPO, SFT and DPO with LoRA (``model.lora``) end to end through the command line on 2 ranks (DP2, and
GRPO at TP2, PP2 with recomputation and CP2); each run takes ~1 min on 2 cores, so all are slow-marked
(make test-slow; the default suite checks LoRA's numerics against PEFT in tests/parallel/test_lora.py).

What a LoRA user relies on: only adapters train (the base weights in the merged export move only by
the adapters' update, and the PEFT adapter on the base model gives the merged export's logits); the
reference is the base (KL exactly 0 at step 0, positive once the adapters moved); the rollout engine
generates with the adapted weights (the verified sync passes and the probe's gap stays at the fp32 floor
after updates); DPO starts at log 2 (policy == reference); a killed and resumed run is bit-identical.
"""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import megarlhf
from megarlhf.data.synthetic import write_preference_task
from megarlhf.records.metrics import read_metrics
from megarlhf.testing.launch import run_torchrun

from _rl_recipe import kill_after_checkpoint, write_recipe

CLI = Path(megarlhf.__file__).with_name("__main__.py")
REWARDS = {"PYTHONPATH": str(Path(__file__).parent)}  # the test reward module '_rewards'

LORA = ["model.lora={rank: 4, alpha: 8.0}"]
SIGNAL = ["reward.functions=[{name: '_rewards:even_length'}]", "optim.lr=1.0e-2", "eval.every=0"]
TIMING = ("time/", "weight_sync/bytes_per_s", "memory/")  # measured, not computed


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _check_exports(base: Path, run: Path) -> None:
    """The merged export differs from the base, and PEFT's adapter on the base gives its logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert (_logits(merged, ids) - _logits(original, ids)).abs().max() > 1e-4  # the adapters learned
    adapted = PeftModel.from_pretrained(original, run / "hf-adapter").eval()
    assert (_logits(adapted, ids) - _logits(merged, ids)).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", [
    pytest.param([], marks=pytest.mark.slow, id="dp2"),
    pytest.param(["parallel.tensor_model_parallel_size=2"], marks=pytest.mark.slow, id="tp2"),
    pytest.param(["parallel.pipeline_model_parallel_size=2", "train.recompute.granularity=full"],
                 marks=pytest.mark.slow, id="pp2-recompute"),
    pytest.param(["parallel.context_parallel_size=2"], marks=pytest.mark.slow, id="cp2"),
])
def test_grpo_with_lora(rl_assets, tmp_path, layout):
    recipe = write_recipe(tmp_path / "grpo.yaml", rl_assets, "grpo", tmp_path / "run")
    run_torchrun(CLI, 2, ["train", str(recipe), *LORA, *SIGNAL, "train.steps=3", *layout], timeout_s=900,
                 env=REWARDS)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["gates/calibration_checkpoint_bitwise"] == 1.0  # fresh adapters merge to W exactly
    assert records[0]["actor/kl_loss"] == 0.0  # the reference is the base: equal to the actor at step 0
    assert records[2]["actor/kl_loss"] > 0.0  # ... and not the actor once the adapters moved
    assert all(r["actor/grad_norm"] > 0 for r in records)
    assert all(r["weight_sync/probe_max_abs_diff"] < 1e-4 for r in records)  # the engine has the merged weights
    _check_exports(rl_assets[0], tmp_path / "run")


@pytest.mark.slow  # two 2-rank runs (~70 s): make test-slow
def test_sft_and_dpo_with_lora(rl_assets, tmp_path):
    model, data = rl_assets
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
model: {{path: {model}, dtype: float32, lora: {{rank: 4, alpha: 8.0}}}}
data: {{chat_template: never, max_sequence_length: 256}}
optim: {{lr: 1.0e-2}}
train: {{steps: 3, global_batch_size: 8, micro_batch_tokens: 512}}
eval: {{every: 0}}
checkpoint: {{every: 0}}
logging: {{backends: []}}
""")
    run_torchrun(CLI, 2, ["sft", str(recipe), f"data.train_path={data}/sft_train.jsonl",
                          f"logging.run_dir={tmp_path / 'sft'}"], timeout_s=900)
    sft = [r for r in read_metrics(tmp_path / "sft" / "metrics.jsonl") if "sft/loss" in r]
    assert len(sft) == 3 and sft[-1]["sft/loss"] < sft[0]["sft/loss"]
    _check_exports(model, tmp_path / "sft")

    write_preference_task(tmp_path / "pairs", n_train=32, n_heldout=8, seed=0, max_steps=1)
    run_torchrun(CLI, 2, ["dpo", str(recipe), f"data.train_path={tmp_path}/pairs/pairs_train.jsonl",
                          f"logging.run_dir={tmp_path / 'dpo'}"], timeout_s=900)
    dpo = [r for r in read_metrics(tmp_path / "dpo" / "metrics.jsonl") if "dpo/loss" in r]
    assert dpo[0]["dpo/loss"] == pytest.approx(0.693147, abs=1e-5)  # the reference is the adapters-off base
    assert dpo[-1]["dpo/loss"] < dpo[0]["dpo/loss"]
    _check_exports(model, tmp_path / "dpo")


@pytest.mark.slow  # three 2-rank runs (~3 min on 2 cores): make test-slow
def test_lora_run_killed_and_resumed_matches_uninterrupted_and_exports(rl_assets, tmp_path):
    overrides = [*LORA, *SIGNAL, "train.steps=4", "checkpoint.every=2"]
    full = write_recipe(tmp_path / "full.yaml", rl_assets, "gae", tmp_path / "full")  # the critic has LoRA too
    run_torchrun(CLI, 2, ["train", str(full), *overrides], timeout_s=900, env=REWARDS)
    cut = write_recipe(tmp_path / "cut.yaml", rl_assets, "gae", tmp_path / "cut")
    kill_after_checkpoint(CLI, ["train", str(cut), *overrides], tmp_path / "cut" / "checkpoints" / "step_2",
                          tmp_path / "cut" / "checkpoints" / "step_4", env=REWARDS)
    run_torchrun(CLI, 2, ["train", str(cut), *overrides, "checkpoint.resume=auto"], timeout_s=900, env=REWARDS)
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]  # noqa: E731
    assert strip(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == strip(read_metrics(tmp_path / "full" / "metrics.jsonl"))
    assert read_metrics(tmp_path / "cut" / "samples.jsonl") == read_metrics(tmp_path / "full" / "samples.jsonl")
    # `megarlhf export` of the last checkpoint writes what the run exported: merged weights and the adapter
    run_torchrun(CLI, 1, ["export", str(full), *overrides, "checkpoint.resume=auto", "--out",
                          str(tmp_path / "exported")], timeout_s=600, env=REWARDS)
    for ran, exported in ((tmp_path / "full" / "hf" / "model.safetensors", tmp_path / "exported" / "model.safetensors"),
                          (tmp_path / "full" / "hf-adapter" / "adapter_model.safetensors",
                           tmp_path / "exported-adapter" / "adapter_model.safetensors")):
        ran, exported = load_file(str(ran)), load_file(str(exported))
        assert ran.keys() == exported.keys() and all(torch.equal(ran[k], exported[k]) for k in ran)


@pytest.mark.slow  # one 2-rank run (~50 s): make test-slow
def test_grpo_with_lora_in_bf16_reports_what_the_merge_rounded_away(rl_assets, tmp_path):
    recipe = write_recipe(tmp_path / "grpo.yaml", rl_assets, "grpo", tmp_path / "run")
    run_torchrun(CLI, 2, ["train", str(recipe), *LORA, *SIGNAL, "train.steps=3", "model.dtype=bfloat16"],
                 timeout_s=900, env=REWARDS)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    rounding = [r["weight_sync/lora_merge_rounding"] for r in records[:3]]
    assert rounding[0] == 0.0  # fresh adapters: nothing to lose
    assert all(0.0 < x < 1.0 for x in rounding[1:])  # bf16 merges drop part of a small update
    assert records[2]["actor/kl_loss"] > 0.0


ADAPTER_SYNC = ["rollout.weight_sync.lora=adapter"]


@pytest.mark.slow  # three 2-rank runs (~3 min on 2 cores): make test-slow
def test_grpo_with_adapter_only_sync_at_tp2_resumes_bit_identically(rl_assets, tmp_path):
    """The engines keep the base and receive only the adapters (gathered over TP2): each sync verifies the
    adapter slots bit for bit and the probe; a killed and resumed run (fresh engines, adapters resent from
    the checkpoint) is bit-identical to the uninterrupted one."""
    overrides = [*LORA, *SIGNAL, *ADAPTER_SYNC, "parallel.tensor_model_parallel_size=2", "train.steps=4",
                 "checkpoint.every=2"]
    full = write_recipe(tmp_path / "full.yaml", rl_assets, "grpo", tmp_path / "full")
    run_torchrun(CLI, 2, ["train", str(full), *overrides], timeout_s=900, env=REWARDS)
    records = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[0]["gates/calibration_checkpoint_bitwise"] == 1.0  # the engine's base is the trainer's
    assert records[3]["actor/kl_loss"] > 0.0 and "weight_sync/lora_merge_rounding" not in records[0]
    assert all(r["weight_sync/probe_max_abs_diff"] < 1e-4 for r in records)  # the LoRA kernels see the adapters
    adapter_bytes = load_file(str(tmp_path / "full" / "hf-adapter" / "adapter_model.safetensors"))
    assert records[0]["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in adapter_bytes.values())

    cut = write_recipe(tmp_path / "cut.yaml", rl_assets, "grpo", tmp_path / "cut")
    kill_after_checkpoint(CLI, ["train", str(cut), *overrides], tmp_path / "cut" / "checkpoints" / "step_2",
                          tmp_path / "cut" / "checkpoints" / "step_4", env=REWARDS)
    run_torchrun(CLI, 2, ["train", str(cut), *overrides, "checkpoint.resume=auto"], timeout_s=900, env=REWARDS)
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]  # noqa: E731
    assert strip(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == strip(records)
    assert read_metrics(tmp_path / "cut" / "samples.jsonl") == read_metrics(tmp_path / "full" / "samples.jsonl")


@pytest.mark.slow  # one 2-rank run (~1 min): make test-slow
def test_grpo_with_adapter_only_sync_disaggregated(rl_assets, tmp_path):
    """1 trainer + 1 engine rank: the adapters travel as one bucket to the engine rank, which loads them
    into its out-of-process LoRA engine; the slots and the probe are verified at every sync."""
    recipe = write_recipe(tmp_path / "grpo.yaml", rl_assets, "grpo", tmp_path / "run")
    run_torchrun(CLI, 2, ["train", str(recipe), *LORA, *SIGNAL, *ADAPTER_SYNC, "train.steps=3",
                          "rollout.placement={mode: disaggregated, num_engine_ranks: 1}"], timeout_s=900, env=REWARDS)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["gates/calibration_checkpoint_bitwise"] == 1.0
    assert all(r["weight_sync/probe_max_abs_diff"] < 1e-4 for r in records)
    assert records[2]["actor/kl_loss"] > 0.0
    adapter = load_file(str(tmp_path / "run" / "hf-adapter" / "adapter_model.safetensors"))
    assert records[0]["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in adapter.values())


def _peft_adapter(base: Path, out: Path) -> Path:
    """A PEFT adapter of ``base`` trained elsewhere, as it were: random factors, a different A for each of
    q, k, v (gate, up) projection, no entry near 0."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:  # |entries| >= 0.02: an fp32 ulp there (~2e-9) dwarfs a 1e-12 step
                values = torch.randn(param.shape, generator=gen)
                param.copy_(values.sign() * (0.02 + 0.03 * values.abs()))
    model.save_pretrained(out)
    return out


@pytest.mark.slow  # one 2-rank run (~1 min): make test-slow
def test_a_peft_adapter_starts_a_canonical_lora_run_at_tp2_with_adapter_only_sync(rl_assets, tmp_path):
    """``model.lora.canonical`` + ``adapter_path``: a PEFT adapter with an A per projection starts the run
    exactly, at TP2, with the engines receiving the adapters alone (vLLM keeps one A per q/k/v slice). With
    lr 1e-12 Adam's first step (~lr per entry) is below half an fp32 ulp of every factor, so the run's
    exported adapter must equal the starting one bit for bit: loaded, sharded over TP2, gathered and
    written back exactly."""
    start = _peft_adapter(rl_assets[0], tmp_path / "start")
    recipe = write_recipe(tmp_path / "grpo.yaml", rl_assets, "grpo", tmp_path / "run")
    lora = f"model.lora={{rank: 4, alpha: 8.0, canonical: true, adapter_path: {start}}}"
    run_torchrun(CLI, 2, ["train", str(recipe), lora, *SIGNAL, "optim.lr=1.0e-12", "train.steps=1",
                          "parallel.tensor_model_parallel_size=2", *ADAPTER_SYNC], timeout_s=900, env=REWARDS)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records[0]["actor/kl_loss"] > 0.0  # the policy starts from the adapter, the reference is the base
    assert records[0]["weight_sync/probe_max_abs_diff"] < 1e-4  # the engine generates with those adapters
    exported = load_file(str(tmp_path / "run" / "hf-adapter" / "adapter_model.safetensors"))
    source = load_file(str(start / "adapter_model.safetensors"))
    assert exported.keys() == source.keys() and all(torch.equal(exported[k], source[k]) for k in source)
    _check_exports(rl_assets[0], tmp_path / "run")
