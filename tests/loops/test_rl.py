"""The RL driver end to end: GRPO and PPO (GAE critic) for a few steps on 2 ranks in several layouts,
with vLLM engines, in fp32 and in bf16 (Megatron bf16 + vLLM bf16, as real-size recipes run).

Checks what a user relies on: every step records the documented metrics; the step-0 gate holds (the
actor's recomputed log-probs equal vLLM's within the dtype's tolerance, and actor/ppo_kl is 0); the run
leaves TensorBoard events, curves and an HF export that transformers loads.
"""
import pytest

from megarlhf.rollout.sync.gates import FLOORS
from megarlhf.records.metrics import read_metrics
from megarlhf.testing.launch import run_torchrun

from _rl_recipe import WORKER, write_recipe

ALWAYS = ["reward/mean", "reward/std", "response_len/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy",
          "actor/grad_norm", "actor/lr", "mismatch/logprob_abs_diff_max", "time/step_s", "time/rollout_s",
          "time/weight_sync_s", "time/train_s"]


def _run(tmp_path, assets, estimator, tp, pp, temperature, dtype):
    recipe = write_recipe(tmp_path / "recipe.yaml", assets, estimator, tmp_path / "run")
    run_torchrun(WORKER, 2, [str(recipe), f"parallel.tensor_model_parallel_size={tp}",
                             f"parallel.pipeline_model_parallel_size={pp}", f"rollout.temperature={temperature}",
                             f"model.dtype={dtype}"], timeout_s=900)
    return tmp_path / "run"


# GRPO at TP=2 runs by default in fp32 and bf16; PPO at PP=2 and the (1,1) layouts are in the slow set
# (make test-slow). GRPO samples at temperature 0.7: the engine must then report temperature-scaled
# log-probs, as the trainer computes them (with vLLM's raw log-probs the step-0 gate fails by ~4 nats).
@pytest.mark.parametrize("estimator,tp,pp,temperature,dtype", [
    pytest.param("grpo", 2, 1, 0.7, "float32", marks=pytest.mark.slow),
    pytest.param("gae", 1, 2, 1.0, "float32", marks=pytest.mark.slow),
    ("grpo", 2, 1, 0.7, "bfloat16"), pytest.param("gae", 1, 2, 1.0, "bfloat16", marks=pytest.mark.slow),
    pytest.param("grpo", 1, 1, 1.0, "float32", marks=pytest.mark.slow),
    pytest.param("gae", 1, 1, 1.0, "float32", marks=pytest.mark.slow)])
def test_rl_run_records_metrics_and_passes_step0_gate(tmp_path, rl_assets, estimator, tp, pp, temperature, dtype):
    run = _run(tmp_path, rl_assets, estimator, tp, pp, temperature, dtype)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]  # two RL steps, then the final evaluation
    for record in records[:2]:
        missing = [k for k in ALWAYS + (["critic/value_loss"] if estimator == "gae" else []) if record.get(k) is None]
        assert not missing, f"step {record['step']} lacks {missing}"
        assert record["train/shared_prefix_tokens_saved"] > 0  # 4 samples per prompt share it
    step0 = records[0]
    assert abs(step0["actor/ppo_kl"]) < 1e-6
    gates = FLOORS[dtype]  # the tiny model calibrates below the floors
    assert step0["mismatch/step0_logprob_gap_max"] <= gates.step0_max
    assert step0["mismatch/step0_logprob_gap_mean"] <= gates.step0_mean
    # the engines held what step 0's sync would send (their own load, checked bit for bit): nothing was sent,
    # and step 0's samples gave the natural floor. The random model earns no reward, so GRPO's advantages
    # and the update are zero and step 1 sends nothing either; GAE's critic moves the actor
    assert step0["weight_sync/skipped"] == 1.0
    assert step0["gates/calibration_natural_mean"] == step0["mismatch/step0_logprob_gap_mean"]
    moved = step0["actor/grad_norm"] > 0
    assert records[1]["weight_sync/skipped"] == (0.0 if moved else 1.0), (step0["actor/grad_norm"], records[1])
    if moved:
        assert records[1]["weight_sync/probe_mean_abs_diff"] <= gates.probe_mean == step0["gates/probe_mean"]
    if dtype == "float32":  # trainer and vLLM agree to fp32 accuracy at step 0
        assert step0["mismatch/step0_logprob_gap_max"] < 1e-4
    assert "eval/accuracy" in step0 and "eval/accuracy" in records[2]
    phases = {k: v for k, v in step0.items() if k.startswith("time/startup/")}  # where start-up went, once
    assert {"time/startup/engine_s", "time/startup/calibration_probe_s"} <= phases.keys()
    assert "time/startup/calibration_natural_samples_s" not in phases  # step 0 measured the natural floor
    assert step0["time/startup_s"] == pytest.approx(sum(phases.values())) and "time/startup_s" not in records[1]
    samples = read_metrics(run / "samples.jsonl")  # the default 4 per step and per evaluation
    assert [(r["step"], r["kind"]) for r in samples[::4]] == [(0, "eval"), (0, "train"), (1, "train"), (2, "eval")]
    assert all(r["response"] and r["prompt"] and r["ground_truth"] is not None and r["reward"] in (0.0, 1.0)
               and r["finish_reason"] in ("stop", "length") for r in samples)
    # colocated, synchronous: every token sampled by the weights of its step (the final evaluation's: after 2)
    assert all(r["policy_versions"] == [[r["step"], r["response_tokens"]]] for r in samples)
    assert [(r["rollout/staleness"], r["rollout/staleness_mean"]) for r in records[:2]] == [(0.0, 0.0)] * 2
    assert (run / "curves.png").is_file() and any((run / "tensorboard").iterdir())
    assert (run / "config.yaml").is_file()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "hf")


@pytest.mark.slow
def test_one_engine_over_both_ranks_serves_two_data_parallel_replicas(tmp_path, rl_assets):
    """rollout.tensor_parallel_size=2 at trainer DP2: the replicas' prompts go to the shared vLLM engine together
    (before, each rank passed its own replica's prompts to an engine that needs the same requests on every
    rank, and the step-0 gate failed: max gap 2.9, mean 0.57)."""
    recipe = write_recipe(tmp_path / "recipe.yaml", rl_assets, "grpo", tmp_path / "run")
    run_torchrun(WORKER, 2, [str(recipe), "rollout.tensor_parallel_size=2"], timeout_s=900)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    step0 = records[0]
    assert [r["step"] for r in records] == [0, 1, 2] and step0["mismatch/step0_logprob_gap_max"] < 1e-4
    samples = [r for r in read_metrics(tmp_path / "run" / "samples.jsonl") if r["kind"] == "train"]
    assert samples and all(r["response"] for r in samples)


# vLLM's run (~50 s) is in the slow set; the fake engine's shows by default that an engine rank serves any
# backend through the contract (its weights arrive in a load session of shared-memory buckets)
@pytest.mark.parametrize("backend", ["fake", pytest.param("vllm", marks=pytest.mark.slow)])
def test_disaggregated_placement_runs_the_driver(tmp_path, rl_assets, backend):
    """1 trainer rank + 1 engine rank: the whole driver, with the optimizer, the checkpoints and the export
    that gather over the trainers only, and the engine rank serving (vLLM out of process)."""
    recipe = write_recipe(tmp_path / "recipe.yaml", rl_assets, "grpo", tmp_path / "run")
    run_torchrun(WORKER, 2, [str(recipe), "rollout.placement={mode: disaggregated, num_engine_ranks: 1}",
                             "checkpoint.every=1", f"rollout.backend={backend}", "optim.lr=1.0e-3",
                             "reward.functions=[{name: '_rewards:even_length'}]"], timeout_s=900)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    step0 = records[0]
    assert step0["mismatch/step0_logprob_gap_max"] < 1e-4 and abs(step0["actor/ppo_kl"]) < 1e-6
    # step 0 sends nothing (the engine holds its own load, checked bit for bit); step 1 sends the update
    assert step0["gates/calibration_probe_mean"] < 1e-5 and step0["weight_sync/skipped"] == 1.0
    assert step0["actor/grad_norm"] > 0 and records[1]["weight_sync/tensors"] > 0
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir())[-1].endswith("2")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")


DISAGGREGATED = "rollout.placement={mode: disaggregated, num_engine_ranks: 1}"


@pytest.mark.parametrize("layout, ranks, overrides", [
    ("colocate DP2", 2, []),
    # (one trainer beside the engine rank: the off-policy case below)
    # a tool whose answers differ call by call: replicas keep their own seeds (DP2) and a replica's
    # model-parallel peers run each call once and share its answer (TP2)
    pytest.param("disaggregated DP2", 3, [DISAGGREGATED, "rollout.env.kwargs={random: true}"], marks=pytest.mark.slow),
    pytest.param("disaggregated TP2", 3, [DISAGGREGATED, "rollout.env.kwargs={random: true}",
                                          "parallel.tensor_model_parallel_size=2"], marks=pytest.mark.slow),
    # the engine rank runs whole episodes, tools included, while the trainers update on the previous batch
    # (a reward that varies, so that the update moves the weights the next batch is one update behind)
    pytest.param("disaggregated off-policy", 2, [DISAGGREGATED, "rollout.max_staleness=1", "optim.lr=1.0e-3",
                                                 "reward.functions=[{name: '_rewards:even_length'}]"],
                 marks=pytest.mark.slow),
])
def test_multi_turn_rollouts_pass_step0_gate(tmp_path, rl_assets, layout, ranks, overrides):
    """Every turn of the random model 'calls' a scripted tool (tests/loops/_worker_multi_turn.py), so
    samples are 3 model turns with 2 observations between them (the third turn's call is not run: no turn
    is left to read it): the observation tokens carry log-prob 0 in the rollout, and the step-0 gate
    (trainer vs vLLM on response tokens) holds to fp32 accuracy only because they are masked out of the
    response."""
    from pathlib import Path

    recipe = write_recipe(tmp_path / "recipe.yaml", rl_assets, "grpo", tmp_path / "run")
    run_torchrun(Path(__file__).with_name("_worker_multi_turn.py"), ranks,
                 [str(recipe), "rollout.env={name: scripted, parser: every_turn, max_turns: 3, describe_tools: false}",
                  "rollout.max_new_tokens=8", "rollout.max_response_tokens=160", *overrides], timeout_s=1200)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    step0 = records[0]
    assert step0["tools/call_rate"] == 1.0 and step0["tools/turns_mean"] == 3.0
    assert step0["tools/calls"] == 2 * step0["tools/samples"] and step0["tools/errors"] == 0
    assert step0["tools/not_run"] == step0["tools/samples"]
    assert step0["response_len/mean"] > 3 * 8  # three turns of 8 tokens plus the observations
    assert step0["mismatch/step0_logprob_gap_max"] < 1e-4
    assert step0["eval/tools/call_rate"] == 1.0 and records[-1]["step"] == 2
    if "rollout.max_staleness=1" in overrides:
        steps = records[:2]  # the last record holds the final evaluation only
        assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0]
        assert [r["rollout/staleness_mean"] for r in steps] == [0.0, 1.0]  # the observation tokens not counted
        assert all(r["tools/call_rate"] == 1.0 and r["tools/not_run"] == r["tools/samples"] for r in steps)
        assert steps[1]["mismatch/is_weight_mean"] != 1.0  # sampled one update behind, and corrected for it
