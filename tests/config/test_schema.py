"""RunConfig: a YAML recipe plus overrides fills every section with the right types; the algorithm
configs' own validation, Literal fields and (through megarlhf.run.checks, as every command runs it) registry
names give errors naming the key; round trip."""
from __future__ import annotations

import pytest

from megarlhf.algorithms.advantages import estimator_needs
from megarlhf.config.algorithm import AdvantageConfig, KLConfig, OverlongConfig, PolicyLossConfig
from megarlhf.config import ConfigError, RunConfig, load_config, save_config
from megarlhf.config.reward import RewardSpec
from megarlhf.config.parallel import ParallelConfig
from megarlhf.run.checks import check_config

RECIPE = """
model:
  path: /models/tiny
  dtype: float32
data:
  train_path: /data/train.jsonl
  eval_path: /data/heldout.jsonl
  max_prompt_length: 256
parallel:
  tensor_model_parallel_size: 2
rollout:
  n_samples: 4
  max_new_tokens: 128
algorithm:
  estimator: grpo
  policy_loss: ppo_clip
  policy: {clip_eps_high: 0.28, dual_clip_c: 3.0}
  kl: {coef: 0.0}
reward:
  functions:
    - name: math_verify
    - {name: numeric, weight: 0.5, kwargs: {rel_tol: 1.0e-3}}
  timeout_s: 5
train: {steps: 20, global_batch_size: 8}
"""


def load_checked(recipe, overrides):
    """What a command gets from a recipe: the loaded config, checked against the registries."""
    config = load_config(RunConfig, recipe, overrides)
    check_config(config)
    return config


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return path


def test_recipe_and_overrides_fill_nested_fields(recipe):
    config = load_config(RunConfig, recipe, [
        "algorithm.advantage.eps=1e-5", "algorithm.policy.clip_eps_high=0.3", "algorithm.kl.estimator=k1",
        "algorithm.mismatch.tis_level=null", "algorithm.overlong={buffer_length: 32}",
        "parallel.pipeline_model_parallel_size=2", "rollout.temperature=0.7", "optim.lr=2e-6",
        "optim.schedule=cosine", "checkpoint.keep_last=null", "eval.n_samples=4", "eval.pass_at_k=[1, 4]",
        "reward.functions.1.weight=2", "seed=7"])
    assert config.model.path == "/models/tiny" and config.model.dtype == "float32"
    assert config.data.max_prompt_length == 256 and config.data.eval_path == "/data/heldout.jsonl"
    assert config.parallel == ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert config.rollout.n_samples == 4 and config.rollout.temperature == 0.7
    assert config.algorithm.advantage == AdvantageConfig(eps=1e-5)
    assert config.algorithm.policy == PolicyLossConfig(clip_eps_high=0.3, dual_clip_c=3.0)
    assert config.algorithm.kl == KLConfig(estimator="k1", coef=0.0)
    assert config.algorithm.mismatch.tis_level is None
    assert config.algorithm.overlong == OverlongConfig(buffer_length=32)
    assert config.optim.lr == 2e-6 and type(config.optim.lr) is float and config.optim.schedule == "cosine"
    assert config.reward.functions == [RewardSpec("math_verify"),
                                       RewardSpec("numeric", 2.0, {"rel_tol": 1e-3})]
    assert config.reward.timeout_s == 5.0 and type(config.reward.timeout_s) is float
    assert config.checkpoint.keep_last is None and config.eval.pass_at_k == [1, 4]
    assert config.train.steps == 20 and config.seed == 7
    assert not estimator_needs(config.algorithm.estimator).critic


@pytest.mark.parametrize("override, message", [
    # unknown keys: full path, closest key, allowed keys
    ("algorithm.kl.coeff=0.1", r"unknown config key 'algorithm\.kl\.coeff' \(did you mean 'algorithm\.kl\.coef'\?\); "
                               r"allowed keys under algorithm\.kl: estimator, coef, clamp_min"),
    ("rollout.temprature=0.5", r"'rollout\.temprature' \(did you mean 'rollout\.temperature'\?\)"),
    ("optim.lr_schedule=cosine", r"'optim\.lr_schedule' \(did you mean 'optim\.schedule'\?\)"),
    # wrong types
    ("train.steps=ten", r"train\.steps: expected int, got 'ten' \(str\)"),
    ("rollout.temperature=[1]", r"rollout\.temperature: expected float, got \[1\]"),
    # the algorithm configs' own range checks, reported under the full key
    ("algorithm.advantage.gamma=1.5", r"algorithm\.advantage\.gamma must be in \[0, 1\], got 1\.5"),
    ("algorithm.policy.clip_eps_low=1.2", r"algorithm\.policy\.clip_eps_low must be < 1"),
    ("algorithm.kl.clamp_min=20", r"algorithm\.kl\.clamp_min \(20\.0\) must be <= algorithm\.kl\.clamp_max"),
    ("algorithm.mismatch.tis_level=batch", r"algorithm\.mismatch\.tis_level must be one of \('token', 'sequence'\)"),
    ("rollout.top_p=0.9", r"rollout\.top_p: top-p / top-k filtering is refused: the trainer scores samples with "
                          r"the full softmax at rollout\.temperature"),
    ("rollout.top_k=50", r"rollout\.top_k: top-p / top-k filtering is refused"),
    # Literal fields list their values
    ("model.dtype=fp8", r"model\.dtype='fp8' is not a supported dtype; supported: float32, bfloat16"),
    ("model.dtype=float16", r"model\.dtype='float16' is not a supported dtype; supported: float32, bfloat16 \(float16 "
                            r"needs loss scaling"),
    ("rollout.dtype=float16", r"rollout\.dtype='float16' is not a supported dtype"),
    ("algorithm.loss_aggregation=mean", r"allowed values: 'token_mean', 'seq_mean_token_sum', "),
    ("optim.schedule=step", r"optim\.schedule: 'step' is not allowed; allowed values: 'constant', 'cosine', 'linear'"),
    # registry names list the known names
    ("algorithm.estimator=ppo", r"algorithm\.estimator: unknown advantage estimator 'ppo'; known: dr_grpo, gae, grpo"),
    ("algorithm.policy_loss=clip", r"algorithm\.policy_loss: unknown policy loss 'clip'; known: cispo, gspo, ppo_clip"),
    ("algorithm.kl.estimator=k4", r"algorithm\.kl\.estimator: unknown KL estimator 'k4'; known: k1, k2, k3"),
    ("reward.functions.0.name=math", r"reward\.functions\.0: unknown reward function 'math'; known: code_tests, exact_match, "
                                     r"math_verify, numeric, repo_tests, or a dotted path"),
    # checks across sections
    ("rollout.n_samples=1",
     r"algorithm\.estimator 'grpo' compares samples of a prompt: rollout\.n_samples must be >= 2"),
    ("algorithm.overlong.buffer_length=128",
     r"algorithm\.overlong\.buffer_length \(128\) must be < the response budget \(128: rollout\.max_new_tokens"),
    ("rollout.max_staleness=1", r"max_staleness=1 needs rollout\.placement\.mode='disaggregated'"),
    ("rollout.max_staleness=17", r"max_staleness must be an int in \[0, 16\] \(0: synchronous; k: samples at most k"),
    ("rollout.max_staleness=true", r"rollout\.max_staleness: expected int, got True \(bool\)"),
    ("rollout.env={name: calculator, max_turns: 0}", r"rollout\.env\.max_turns must be an int >= 1"),
    ("rollout.env={name: nope}", r"rollout\.env\.name: unknown environment 'nope'; known: calculator, code, lookup, "
                                 r"openenv, repo, or a dotted path"),
    ("reward.functions=[]", r"reward\.functions is empty and there is no reward_model_path or judge: with no "
                             r"rollout\.env"),
    ("rollout.env={name: calculator, parser: xml}",
     r"rollout\.env\.parser: unknown tool-call parser 'xml'; known: hermes, mistral, tokenizer"),
    ("rollout.backend=sglang", r"rollout\.backend: unknown rollout engine 'sglang'; known: fake, hf, vllm"),
    ("logging.backends=[comet]", r"logging\.backends: unknown tracking backend\(s\) \['comet'\]"),
    ("eval.pass_at_k=[2]", r"eval\.pass_at_k values must be in \[1, n_samples=1\]"),
    # preference and iterative settings
    ("preference={loss: kto, params: {label_smoothing: 0.1}}",
     r"preference\.loss='kto' has no label smoothing; set preference\.params\.label_smoothing=0"),
    ("preference.params.undesirable_weight=0", r"undesirable_weight must be > 0"),
    ("iterative={rs_keep: threshold, rs_threshold: null}", r"rs_keep='threshold' needs rs_threshold"),
    ("iterative.pair_rule=random", r"iterative\.pair_rule: 'random' is not allowed; allowed values: 'best_worst', 'all'"),
    ("iterative.min_margin=-1", r"iterative\.min_margin must be a finite number >= 0"),
])
def test_bad_values_name_the_key(recipe, override, message):
    with pytest.raises(ConfigError, match=message):
        load_checked(recipe, [override])


def test_what_an_engine_supports_comes_from_its_registry_entry(recipe):
    load_checked(recipe, ["rollout.tensor_parallel_size=2"])  # vLLM spreads one engine over ranks
    for backend in ("hf", "fake"):
        with pytest.raises(ConfigError, match=rf"rollout\.backend='{backend}' runs one engine per rank: "
                                              r"rollout\.tensor_parallel_size must be 1, got 2"):
            load_checked(recipe, [f"rollout.backend={backend}", "rollout.tensor_parallel_size=2"])
    lora = ["model.lora={rank: 8}", "rollout.weight_sync.lora=adapter", "model.dtype=bfloat16"]
    load_checked(recipe, lora)
    with pytest.raises(ConfigError, match=r"needs an engine that loads adapters alone; rollout\.backend='hf'"):
        load_checked(recipe, [*lora, "rollout.backend=hf"])
    with pytest.raises(ConfigError, match=r"model\.lora\.rank: LoRA rank 600: vLLM serves adapters of rank at most 512"):
        load_checked(recipe, ["model.lora={rank: 600}", "rollout.weight_sync.lora=adapter", "model.dtype=bfloat16"])


def test_an_environments_rewards_alone_are_a_reward(recipe):
    config = load_checked(recipe, ["reward.functions=[]", "rollout.env={name: openenv, kwargs: {url: 'http://e:1'}}",
                                   "eval.reward_functions=[{name: math_verify}]"])
    assert config.reward.functions == [] and config.eval_reward.functions[0].name == "math_verify"


def test_off_policy_with_multi_turn_and_dynamic_sampling_is_accepted(recipe):
    config = load_config(RunConfig, recipe, ["rollout.placement={mode: disaggregated, num_engine_ranks: 1}",
                                             "rollout.max_staleness=2", "algorithm.mismatch.tis_level=token",
                                             "rollout.env={name: calculator}"])
    assert config.rollout.max_staleness == 2 and config.rollout.env.name == "calculator"
    config = load_config(RunConfig, recipe, ["rollout.placement={mode: disaggregated, num_engine_ranks: 1}",
                                             "rollout.max_staleness=1", "algorithm.dynamic_sampling.enabled=true"])
    assert config.algorithm.dynamic_sampling.enabled


def test_required_keys(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"missing required config key\(s\): model$"):
        load_config(RunConfig, None, ["data.eval_path=/e"])
    # evaluation reads no training data; the training commands name the key before doing anything else
    assert load_config(RunConfig, None, ["model.path=/m", "data.eval_path=/e"]).data.train_path == ""
    from megarlhf import cli

    recipe = tmp_path / "no_train_data.yaml"
    recipe.write_text("model: {path: /m}\n")
    for command in ("train", "sft"):
        assert cli.main([command, str(recipe)]) == 1
        assert f"megarlhf {command}: error: missing required config key(s): data.train_path" in capsys.readouterr().err


def test_resolved_config_round_trip(recipe, tmp_path):
    config = load_config(RunConfig, recipe, ["algorithm.overlong.buffer_length=16", "optim.adam_eps=1e-12",
                                             "reward.functions.0.kwargs={x: [1, 2.5, null]}"])
    saved = save_config(config, tmp_path / "run" / "config.yaml")
    assert load_config(RunConfig, saved) == config
    # and nothing needs the original recipe: every default is written out
    text = saved.read_text()
    assert "gae_whiten: true" in text and "log_ratio_limit: 20.0" in text and "- tensorboard" in text


def test_what_an_estimator_needs_comes_from_its_registry_entry(recipe):
    from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, EstimatorNeeds

    # reinforce_pp_baseline subtracts a group mean: one sample per prompt would give all-zero advantages
    with pytest.raises(ConfigError, match="'reinforce_pp_baseline' compares samples of a prompt"):
        load_checked(recipe, ["algorithm.estimator=reinforce_pp_baseline", "rollout.n_samples=1"])
    for name in ADVANTAGE_ESTIMATORS.names():
        teacher = []
        if not ADVANTAGE_ESTIMATORS.get(name).needs.rewards:  # learns from a teacher alone: refused without one
            with pytest.raises(ConfigError, match=f"'{name}' learns from no reward"):
                load_checked(recipe, [f"algorithm.estimator={name}"])
            teacher = ["teacher={model_path: /models/teacher}", "algorithm.distill={loss: reverse_kl}"]
        config = load_checked(recipe, [f"algorithm.estimator={name}", *teacher])
        assert estimator_needs(config.algorithm.estimator) == ADVANTAGE_ESTIMATORS.get(name).needs
    assert ADVANTAGE_ESTIMATORS.get("gae").needs == EstimatorNeeds(critic=True)
    assert ADVANTAGE_ESTIMATORS.get("remax").needs == EstimatorNeeds(greedy_baseline=True)
    # a new estimator is one registry entry: config validation and the planner follow its declaration
    from megarlhf.algorithms.advantages import _estimator, gae
    from megarlhf.planner.memory import Launch, plan_memory
    from megarlhf.planner.shapes import ModelShape

    _estimator("test_grouped_critic", critic=True, groups=True)(gae)
    try:
        with pytest.raises(ConfigError, match="'test_grouped_critic' compares samples"):
            load_checked(recipe, ["algorithm.estimator=test_grouped_critic", "rollout.n_samples=1"])
        config = load_checked(recipe, ["algorithm.estimator=test_grouped_critic", "parallel.tensor_model_parallel_size=1"])
        assert estimator_needs(config.algorithm.estimator).critic
        shape = ModelShape(name="test", vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                           head_dim=16, ffn_size=128, tied_embeddings=True, qkv_bias=False, qk_norm=False)
        plan = plan_memory(config, shape, Launch(world_size=1))
        assert plan.stages[0].components["critic_weights"] > 0
    finally:
        ADVANTAGE_ESTIMATORS._entries.pop("test_grouped_critic")


def test_kl_is_on_has_one_definition(recipe):
    on = load_config(RunConfig, recipe, ["algorithm.kl.coef=0.01"]).algorithm
    assert on.kl_mode == "loss" and on.kl_in_loss and not on.kl_in_reward and on.uses_reference
    off = load_config(RunConfig, recipe, ["algorithm.kl_mode=loss", "algorithm.kl.coef=0"]).algorithm
    assert not off.kl_in_loss and not off.kl_in_reward and not off.uses_reference
    reward = load_config(RunConfig, recipe, ["algorithm.kl_mode=reward", "algorithm.kl.coef=0.1"]).algorithm
    assert reward.kl_in_reward and not reward.kl_in_loss and reward.uses_reference
    assert not load_config(RunConfig, recipe, ["algorithm.kl_mode=none", "algorithm.kl.coef=0.1"]).algorithm.uses_reference


def test_removed_settings_are_refused_naming_their_replacement(recipe):
    for key, replacement in (("rollout.gpu_memory_utilization=0.5", "rollout.kv_cache_mb"),
                             ("rollout.weight_sync_bucket_mb=1", "rollout.weight_sync.bucket_mb"),
                             ("train.step0_logprob_tolerance=1e-3", "gates.step0_max"),
                             ("algorithm.policy.clip_eps=0.2", "algorithm.policy.clip_eps_low")):
        with pytest.raises(ConfigError, match=f"was removed; use {replacement}"):
            load_config(RunConfig, recipe, [key])
