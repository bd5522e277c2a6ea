"""The memory plan against hand-worked numbers, and how it composes the colocate phases."""
import json

import pytest

from megarlhf.config import RunConfig, from_dict
from megarlhf.planner import Launch, ModelShape, plan_memory
from megarlhf.planner.memory import GIB, MIB

# A small hand-checkable shape: h=64, F=128, 2 layers, 4 heads x 16, 2 KV heads, vocab 256, untied.
SHAPE = ModelShape(name="toy", hidden_size=64, ffn_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   vocab_size=256, tied_embeddings=False, qkv_bias=False, qk_norm=False)


def _config(**sections) -> RunConfig:
    tree = {"model": {"path": "toy", "dtype": "bfloat16"}, "data": {"train_path": "x", "max_prompt_length": 32},
            "rollout": {"n_samples": 2, "max_new_tokens": 32, "kv_cache_mb": 1, "weight_sync": {"bucket_mb": 1}},
            "train": {"global_batch_size": 4, "micro_batch_tokens": 128}}
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return from_dict(RunConfig, tree)


def test_hand_worked_bf16_distributed_optimizer_dp2():
    # per layer: q 64x64 + k,v 2x64x32 + o 64x64 + mlp 3x64x128 + 2 norms x 64 = 36992; 2 layers 73984;
    # embedding 256x64 + output 256x64 + final norm 64 = 32832 -> 106816 parameters on the one stage
    params = 106816
    plan = plan_memory(_config(algorithm={"kl_mode": "loss"}), SHAPE, Launch(world_size=2))
    st = plan.stages[0]
    assert st.components["actor_weights"] == 2 * params
    assert st.components["actor_grads"] == 4 * params
    assert st.components["actor_optimizer"] == 12 * params // 2  # fp32 master + 2 moments, over DP=2
    assert st.components["reference_weights"] == 2 * params
    # activations per token per layer: bf16 (2h + 3q + 3g + 4hd + 5F) = 128+192+96+64+640 = 1120 elements,
    # fp32 (4h + q + heads) = 256+64+4 = 324; head: 8h bytes + 3 x 256 x 4 (vocab chunk) per token
    tokens = 128
    assert st.components["activations"] == 2 * tokens * (1120 * 2 + 324 * 4) + tokens * (8 * 64 + 3 * 256 * 4)
    engine = SHAPE.total_params() * 2
    assert st.phases["generate"] == engine + 1 * MIB
    assert st.phases["sync"] == 2 * params + engine + max(1 * MIB, 256 * 64 * 2)
    assert st.phases["train"] == sum(st.components[k] for k in st.components if not k.startswith("engine_"))
    assert plan.kv_tokens == MIB // (2 * 2 * 2 * 16 * 2)


def test_lora_trains_adapters_only_and_has_no_reference_copy():
    # rank 2 on all four layers, TP 1, per layer: qkv A 2x64 + B 128x2, proj A 2x64 + B 64x2,
    # fc1 A 2x64 + B 256x2, fc2 A 2x128 + B 64x2 = 384 + 256 + 640 + 384 = 1664; 2 layers 3328
    params, adapters = 106816, 3328
    lora = {"lora": {"rank": 2, "alpha": 4.0}}
    st = plan_memory(_config(model=lora, algorithm={"kl_mode": "loss", "estimator": "gae"}), SHAPE,
                     Launch(world_size=2)).stages[0]
    assert st.components["actor_weights"] == 2 * (params + adapters)
    assert st.components["actor_grads"] == 4 * adapters
    assert st.components["actor_optimizer"] == 12 * adapters // 2
    assert st.components["reference_weights"] == 0  # the actor's base with adapters off
    critic_trained = adapters + 64  # the value head trains too
    assert st.components["critic_grads"] == 4 * critic_trained
    assert st.components["critic_optimizer"] == 12 * critic_trained // 2
    # TP2 halves B of column layers and A of row layers: 128+128 + 64+128 + 128+256 + 128+128 = 1088
    assert SHAPE.lora_layer_params(2, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], 2) == 1088


def test_fp32_plain_optimizer_and_cpu_keeps_everything_resident():
    plan = plan_memory(_config(model={"dtype": "float32"}, optim={"use_distributed_optimizer": False},
                               algorithm={"kl_mode": "none"}), SHAPE, Launch(world_size=2, device="cpu"))
    st = plan.stages[0]
    assert st.components["actor_optimizer"] == 8 * st.components["actor_weights"] // 4  # 2 fp32 moments, unsharded
    assert st.components["reference_weights"] == 0
    assert st.phases["train"] == st.phases["generate"] == sum(st.components.values())


def test_pipeline_stages_and_critic():
    plan = plan_memory(_config(parallel={"pipeline_model_parallel_size": 2}, algorithm={"estimator": "gae"}),
                       SHAPE, Launch(world_size=2))
    first, last = plan.stages
    assert first.components["critic_weights"] > 0
    # 1F1B: the first stage holds 2 micro-batches of its layer in flight, the last one
    assert first.components["activations"] > last.components["activations"] - 128 * (8 * 64 + 3 * 256 * 4)
    assert first.activations_recompute < first.components["activations"]


def test_learned_reward_model_weights_from_its_own_config(tmp_path):
    # the reward model is half the actor's depth: its own config.json sizes it, with a 1-wide value head
    # (h) in place of the untied 256 x 64 output layer: 36992 + 256x64 + 64 + 64 = 53504 parameters
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForSequenceClassification"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 256, "tie_word_embeddings": False, "num_labels": 1}))
    without = plan_memory(_config(), SHAPE, Launch(world_size=2)).stages[0]
    plan = plan_memory(_config(reward={"reward_model_path": str(tmp_path)}), SHAPE, Launch(world_size=2))
    st = plan.stages[0]
    assert without.components["reward_model_weights"] == 0
    assert st.components["reward_model_weights"] == 2 * 53504
    assert st.phases["train"] == without.phases["train"] + 2 * 53504
    assert st.phases["generate"] == without.phases["generate"]  # offloaded around rollouts like the reference


def test_a_judge_is_counted_in_its_own_dtype_and_phase(tmp_path):
    # the judge: 1 layer of the toy's widths, untied: 36992 + 2 x 256 x 64 + 64 = 69824 parameters, in fp32
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256, "tie_word_embeddings": False}))
    judge = {"judge": {"model_path": str(tmp_path), "dtype": "float32", "kv_cache_mb": 3}}
    without_plan = plan_memory(_config(), SHAPE, Launch(world_size=2))
    plan = plan_memory(_config(reward=judge), SHAPE, Launch(world_size=2))
    without, st = without_plan.stages[0], plan.stages[0]
    assert (st.components["judge_weights"], st.components["judge_kv_cache"]) == (4 * 69824, 3 * MIB)
    assert plan.host_offload == without_plan.host_offload + 4 * 69824  # asleep on the host
    trainer_state = without.phases["train"] - without.components["activations"]
    assert st.phases["judge"] == trainer_state + 4 * 69824 + 3 * MIB  # judged with the trainer state back
    assert without.phases["judge"] == 0
    for phase in ("train", "sync", "generate"):  # asleep, on the host, the rest of the step
        assert st.phases[phase] == without.phases[phase]
    cpu = plan_memory(_config(reward=judge), SHAPE, Launch(world_size=2, device="cpu")).stages[0]
    assert cpu.phases["train"] == cpu.phases["judge"] == sum(cpu.components.values())
    sft = plan_memory(_config(reward=judge), SHAPE, Launch(world_size=2, command="sft")).stages[0]
    assert sft.components["judge_weights"] == sft.phases["judge"] == 0  # sft rewards no samples
    with pytest.raises(ValueError, match="reward.judge.model_path='/nowhere/judge'"):
        plan_memory(_config(reward={"judge": {"model_path": "/nowhere/judge"}}), SHAPE, Launch(world_size=2))


def test_a_teacher_in_its_own_layout_is_counted_in_that_layout(tmp_path):
    # the teacher is the toy itself (its config.json), bf16: 106816 parameters in the student's layout (DP 2);
    # at TP 2 every matrix is halved, the 5 norms of 64 (2 a layer, the final one) are not: (106816 - 320) / 2 + 320
    # = 53568;
    # at PP 2 the heavier stage is the last: 1 layer (36992) + output (16384) + final norm (64) = 53440
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256, "tie_word_embeddings": False}))
    teacher = {"model_path": str(tmp_path)}
    algorithm = {"estimator": "none", "kl_mode": "none", "distill": {"loss": "reverse_kl"}}

    def teacher_bytes(**layout) -> list[int]:
        config = _config(teacher={**teacher, **({"parallel": layout} if layout else {})}, algorithm=algorithm,
                         reward={"functions": []})
        return [st.components["teacher_weights"] for st in plan_memory(config, SHAPE, Launch(world_size=2)).stages]

    assert teacher_bytes() == [2 * 106816]
    assert teacher_bytes(tensor_model_parallel_size=2) == [2 * 53568]
    assert teacher_bytes(pipeline_model_parallel_size=2) == [2 * 53440]
    # its scores: 4 prompts x 2 samples over DP 2 = 4 rows a replica, 32 + 32 tokens, one fp32 log-prob each; in
    # its own layout one teacher replica scores both student replicas' rows and each rank keeps its own copy
    config = _config(teacher=teacher, algorithm=algorithm, reward={"functions": []})
    st = plan_memory(config, SHAPE, Launch(world_size=2)).stages[0]
    assert st.components["teacher_scores"] == 4 * 64 * 4
    assert st.phases["train"] == sum(v for k, v in st.components.items() if not k.startswith("engine_"))
    gkd = {**algorithm, "estimator": "none", "distill": {"loss": "gkd", "top_k": 8}}
    own = _config(teacher={**teacher, "parallel": {"tensor_model_parallel_size": 2}}, algorithm=gkd,
                  reward={"functions": []})
    plan = plan_memory(own, SHAPE, Launch(world_size=2))
    assert plan.stages[0].components["teacher_scores"] == (2 + 1) * 4 * 64 * (4 + 8 * 12 + 4)
    assert plan.host_offload == plan.stages[0].phases["train"] - plan.stages[0].components["activations"] - (
        plan.stages[0].components["teacher_scores"])  # the scores are not offloaded: they exist while training
    with pytest.raises(ValueError, match=r"teacher.parallel \(.*\): tensor_model_parallel_size=8 does not divide"):
        plan_memory(_config(teacher={**teacher, "parallel": {"tensor_model_parallel_size": 8}}, algorithm=algorithm,
                            reward={"functions": []}, train={"global_batch_size": 8}), SHAPE, Launch(world_size=8))
    with pytest.raises(ValueError, match=r"teacher.parallel \(.*\): world size 2 is not divisible by tensor_model"):
        teacher_bytes(tensor_model_parallel_size=4)


def test_the_smallest_world_fits_a_teachers_own_layout_too():
    from megarlhf.config.parallel import ParallelConfig
    from megarlhf.planner.command import smallest_world

    student = ParallelConfig(context_parallel_size=2)
    assert smallest_world(student) == 2 and smallest_world(student, None) == 2
    assert smallest_world(student, ParallelConfig(tensor_model_parallel_size=4)) == 4
    assert smallest_world(student, ParallelConfig(pipeline_model_parallel_size=3)) == 6


def test_layout_errors_name_the_problem():
    with pytest.raises(ValueError, match="not divisible by tensor_model_parallel_size"):
        plan_memory(_config(parallel={"tensor_model_parallel_size": 2}), SHAPE, Launch(world_size=3))
    with pytest.raises(ValueError, match="global_batch_size=4 is not divisible by the data-parallel size 8"):
        plan_memory(_config(), SHAPE, Launch(world_size=8))


def test_refusal_when_over_capacity():
    plan = plan_memory(_config(), SHAPE, Launch(world_size=1, device_memory_gib=3.0005, reserve_gib=3.0))
    assert not plan.fits and "train phase" in plan.problems()[0]
    assert plan.capacity == int(0.0005 * GIB)


@pytest.mark.parametrize("command, overrides, expected", [
    # command, recipe sections, (engine, reference, critic) resident
    ("train", {"algorithm": {"estimator": "gae", "kl_mode": "loss"}}, (True, True, True)),
    ("rs", {"algorithm": {"estimator": "gae", "kl_mode": "loss"}}, (True, False, False)),
    ("online-dpo", {}, (True, True, False)),
    ("online-dpo", {"iterative": {"reference": "refresh"}}, (True, False, False)),
    ("online-dpo", {"preference": {"loss": "simpo"}}, (True, False, False)),
    ("sft", {"algorithm": {"kl_mode": "loss"}}, (False, False, False)),
    ("dpo", {}, (False, True, False)),
    ("dpo", {"preference": {"loss": "simpo"}}, (False, False, False)),
    ("rm", {}, (False, False, False)),
])
def test_each_command_plans_the_models_it_runs(command, overrides, expected):
    plan = plan_memory(_config(data={"max_sequence_length": 96}, **overrides), SHAPE, Launch(world_size=1,
                                                                                              command=command))
    st = plan.stages[0]
    engine, reference, critic = expected
    assert (st.components["engine_weights"] > 0, st.components["reference_weights"] > 0,
            st.components["critic_weights"] > 0) == expected
    assert plan.max_model_len == (64 if engine else 96)  # prompt + response budget, or data.max_sequence_length
    if not engine:
        assert st.phases["sync"] == st.phases["generate"] == 0 and plan.problems() == []
    head_params = SHAPE.params_per_rank(1, 1, 0, "value" if command == "rm" else "lm")
    assert st.components["actor_weights"] == 2 * head_params  # rm trains a value-head model


def test_pair_commands_plan_micro_batches_of_both_sides():
    # micro_batch_tokens 128 < two 96-token sides: a pair's micro-batch holds 192 tokens
    config = _config(data={"max_sequence_length": 96})
    acts = {command: plan_memory(config, SHAPE, Launch(world_size=1, command=command)).stages[0]
            .components["activations"] for command in ("sft", "dpo", "rm")}
    sft_192 = plan_memory(_config(data={"max_sequence_length": 192}), SHAPE, Launch(world_size=1, command="sft"))
    assert acts["dpo"] == sft_192.stages[0].components["activations"] > acts["sft"]
    kto = _config(data={"max_sequence_length": 96}, preference={"loss": "kto"})
    assert plan_memory(kto, SHAPE, Launch(world_size=1, command="dpo")).stages[0].components["activations"] == \
        acts["sft"]  # unpaired rows train one at a time


def test_plan_command_line_names_the_command(capsys, tmp_path):
    from megarlhf.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: x}\ndata: {train_path: x}\n")
    assert main(["plan", "--arch", "smollm2-135m-instruct", "--command", "sft", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "engine     none (megarlhf sft)" in out and "vLLM KV cache" not in out and "offloaded" not in out
    with pytest.raises(SystemExit):
        main(["plan", "--command", "ppo", str(recipe)])


def test_moe_expert_state_is_sharded_over_expert_data_parallel_ranks():
    """Qwen3-30B-A3B at TP1 x PP2 x EP8: the routed experts' Adam state is split over world / (TP x EP x PP)
    expert-DP ranks, the rest over DP x CP; weights and gradients are this rank's share of both."""
    from megarlhf.planner.shapes import PRESETS

    shape = ModelShape.from_hf_config(PRESETS["Qwen3-30B-A3B"], "Qwen3-30B-A3B")
    config = _config(parallel={"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 8},
                     train={"global_batch_size": 64})
    for world, expert_dp in ((16, 1), (32, 2)):
        stage = plan_memory(config, shape, Launch(world_size=world)).stages[0]
        params, experts = shape.params_per_rank(1, 2, 0, ep=8), shape.expert_params_per_rank(1, 2, 0, 8)
        assert experts == 24 * 16 * 3 * 2048 * 768  # 24 layers x 16 local experts x gate/up/down
        assert stage.components["actor_weights"] == 2 * params and stage.components["actor_grads"] == 4 * params
        assert stage.components["actor_optimizer"] == 12 * (params - experts) // (world // 2) + 12 * experts // expert_dp
    with pytest.raises(ValueError, match="expert_model_parallel_size \\(8\\) x pipeline_model_parallel_size \\(2\\)"):
        plan_memory(config, shape, Launch(world_size=8))
    tp2 = _config(parallel={"tensor_model_parallel_size": 2, "expert_model_parallel_size": 8}, train={"global_batch_size": 64})
    with pytest.raises(ValueError, match="plans mixture-of-experts models at TP 1 only"):
        plan_memory(tp2, shape, Launch(world_size=16))
