"""A distillation recipe's start-up checks: what DISTILL_LOSSES entries declare against the settings, a teacher
with another tokenizer or vocabulary refused by name, the teacher read by `megarlhf train` only, and dataset
responses (GKD's lmbda < 1) that do not end the conversation refused naming the row."""
from __future__ import annotations

import json
import shutil

import pytest

from megarlhf.config import ConfigError, RunConfig, load_config
from megarlhf.core.errors import DataError
from megarlhf.run.checks import check_config, check_teacher
from model_providers.tiny_models import make_tiny_model

RECIPE = """
model: {path: STUDENT, dtype: float32}
teacher: {model_path: TEACHER}
data: {train_path: /data/train.jsonl}
algorithm: {estimator: none, distill: {loss: reverse_kl}}
reward: {functions: []}
"""


def _config(tmp_path, *overrides: str, student="/models/student", teacher="/models/teacher") -> RunConfig:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("STUDENT", str(student)).replace("TEACHER", str(teacher)))
    return load_config(RunConfig, recipe, list(overrides))


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.distill.loss=gkd"], r"compares the student's distribution with the teacher's top-k: set "
                                      r"algorithm.distill.top_k >= 1"),
    (["algorithm.distill.top_k=5"], r"algorithm.distill.top_k=5 is unused"),
    (["algorithm.distill.lmbda=0.5"], r"learns on the student's own samples only; set lmbda to 1"),
    (["algorithm.distill={loss: gkd, top_k: 4, lmbda: 0.5}", "algorithm.estimator=grpo"],
     r"a dataset response has no policy-gradient advantage; set algorithm.estimator to 'none'"),
    (["algorithm.distill={loss: gkd, top_k: 4, lmbda: 0.5}", "rollout.max_staleness=1",
      "rollout.placement={mode: disaggregated, num_engine_ranks: 1}"], r"with rollout.max_staleness is not supported"),
    (["algorithm.distill.loss=forward_kl"], r"algorithm.distill.loss.*forward_kl"),
    (["teacher=null", "algorithm.distill=null", "reward.functions=[{name: exact_match}]"],
     r"algorithm.estimator='none' learns from no reward: it is for distillation alone"),
    (["algorithm.kl_mode=reward"], r"kl_mode='reward' puts the KL penalty in the rewards, which algorithm.estimator="),
])
def test_declared_needs_are_checked(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(_config(tmp_path, *overrides))


def test_dataset_steps_must_fill_the_mini_batches(tmp_path):
    from megarlhf.loops.collect import check_dataset_steps

    config = _config(tmp_path, "algorithm.distill={loss: gkd, top_k: 4, lmbda: 0.5}", "train.global_batch_size=4",
                     "train.mini_batches=4", "rollout.n_samples=4")
    check_dataset_steps(config, 1)  # 4 prompts, 4 mini-batches of one dataset response each
    with pytest.raises(ConfigError, match=r"gives each of the 2 data-parallel ranks 2 rows .* fewer than "
                                          r"train.mini_batches=4"):
        check_dataset_steps(config, 2)  # the student's steps would hold 8 rows a rank: only dataset steps fail


def test_teacher_and_distill_go_together(tmp_path):
    with pytest.raises(ConfigError, match="teacher and algorithm.distill go together"):
        _config(tmp_path, "algorithm.distill=null", "reward.functions=[{name: exact_match}]")
    check_config(_config(tmp_path))  # reward.functions: [] with a teacher: distillation alone


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    student = make_tiny_model("qwen2", root / "student", seed=0)
    other_vocab = shutil.copytree(student, root / "wider")
    config = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    other_tokens = shutil.copytree(student, root / "other_tokens")
    tokenizer = json.loads((other_tokens / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens trade ids
    (other_tokens / "tokenizer.json").write_text(json.dumps(tokenizer))
    return student, other_vocab, other_tokens


def test_a_teacher_with_another_tokenizer_is_refused_by_name(tmp_path, models):
    from transformers import AutoTokenizer

    student, other_vocab, other_tokens = models
    tokenizer = AutoTokenizer.from_pretrained(student)
    check_teacher(_config(tmp_path, student=student, teacher=student), tokenizer, 1)
    with pytest.raises(ConfigError, match=r"teacher.model_path='.*other_tokens' has another tokenizer than "
                                          r"model.path=.*\(2 tokens differ, e\.g\."):
        check_teacher(_config(tmp_path, student=student, teacher=other_tokens), tokenizer, 1)
    check_teacher(_config(tmp_path, student=student, teacher=other_vocab), tokenizer, 1)  # reverse_kl: sampled ids only
    with pytest.raises(ConfigError, match=r"the teacher's vocab_size \(448, .*wider\) must equal the student's \(384\)"):
        check_teacher(_config(tmp_path, "algorithm.distill={loss: gkd, top_k: 4}", student=student,
                              teacher=other_vocab), tokenizer, 1)
    with pytest.raises(ConfigError, match=r"algorithm.distill.top_k=385 is more than the vocabulary \(384 tokens\)"):
        check_teacher(_config(tmp_path, "algorithm.distill={loss: gkd, top_k: 385}", student=student,
                              teacher=student), tokenizer, 1)
    with pytest.raises(ConfigError, match=r"teacher.model_path='/nowhere' is not an HF model directory"):
        check_teacher(_config(tmp_path, student=student, teacher="/nowhere"), tokenizer, 1)


def test_a_teacher_layout_that_does_not_split_the_trainer_ranks_or_its_layers_is_refused(tmp_path, models):
    """teacher.parallel is checked at start-up against the trainer ranks and the teacher's own heads and layers
    (the tiny model has 4 heads and 2 layers), before any model is built."""
    from transformers import AutoTokenizer

    student = models[0]
    tokenizer = AutoTokenizer.from_pretrained(student)
    config = _config(tmp_path, "teacher.parallel={tensor_model_parallel_size: 2}", student=student, teacher=student)
    check_teacher(config, tokenizer, 2)
    check_teacher(config, tokenizer, 4)  # TP 2 x DP 2
    with pytest.raises(ConfigError, match=r"teacher.parallel \(teacher .*student, 3 trainer ranks\): world size 3 "
                                          r"is not divisible by tensor_model_parallel_size \(2\)"):
        check_teacher(config, tokenizer, 3)
    deep = _config(tmp_path, "teacher.parallel={pipeline_model_parallel_size: 4}", student=student, teacher=student)
    with pytest.raises(ConfigError, match=r"teacher.parallel .*pipeline_model_parallel_size=4 cannot split the "
                                          r"model's 2 layers"):
        check_teacher(deep, tokenizer, 4)
    wide = _config(tmp_path, "teacher.parallel={tensor_model_parallel_size: 8}", student=student, teacher=student)
    with pytest.raises(ConfigError, match=r"teacher.parallel .*tensor_model_parallel_size=8 does not divide "
                                          r"num_attention_heads=4"):
        check_teacher(wide, tokenizer, 8)
    with pytest.raises(ConfigError, match=r"teacher.parallel.*tensor_model_parallel_size"):
        _config(tmp_path, "teacher.parallel={tensor_model_parallel_size: 0}")
    with pytest.raises(ConfigError, match=r"teacher.parallel.*data_parallel_size"):
        _config(tmp_path, "teacher.parallel={data_parallel_size: 2}")  # unknown keys are errors


def test_the_teacher_is_read_by_train_only(tmp_path, models):
    from megarlhf.run.context import start_run

    student = models[0]
    config = _config(tmp_path, "logging.run_dir=" + str(tmp_path / "run"), student=student, teacher=student)
    with pytest.raises(ConfigError, match="read by megarlhf train only, not by megarlhf sft"):
        start_run(config, "sft")


def test_dataset_responses_must_end_the_conversation(models):
    from transformers import AutoTokenizer

    from megarlhf.config.data import DataConfig
    from megarlhf.data.prompts import build_prompt_dataset

    tokenizer = AutoTokenizer.from_pretrained(models[0])
    config = DataConfig(train_path="x", messages_key="messages")
    good = {"messages": [{"role": "user", "content": "1 plus 2 is"}, {"role": "assistant", "content": "3"}]}
    dataset = build_prompt_dataset([good], tokenizer, config, response_budget=16)
    example = dataset[0]
    assert tokenizer.decode(example.response_ids) == "3<|im_end|>\n"
    assert tokenizer.decode(example.prompt_ids).endswith("<|im_start|>assistant\n")  # the answer is not in the prompt
    bad = {"messages": good["messages"][:1]}
    with pytest.raises(DataError, match=r"<rows> row 1: the conversation must end with the assistant's response"):
        build_prompt_dataset([good, bad], tokenizer, config, response_budget=16)
    plain = build_prompt_dataset([{"prompt": "1 plus 2 is", "response": " 3"}], tokenizer,
                                 DataConfig(train_path="x", chat_template="never"), response_budget=16)
    assert plain[0].response_ids[-1] == tokenizer.eos_token_id
    # a response longer than the budget is dropped and counted, like a long prompt
    long = {"messages": [good["messages"][0], {"role": "assistant", "content": "3 " * 40}]}
    dataset = build_prompt_dataset([good, long, good], tokenizer, config, response_budget=16)
    assert [e.index for e in dataset] == [0, 2] and dataset.num_dropped == 1
    # a template that writes no assistant turn leaves nothing to train on: refused naming the row
    tokenizer.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}U: {{ m['content'] }}\n{% endif %}{% endfor %}"
    with pytest.raises(DataError, match="row 0: the assistant's response renders to no tokens"):
        build_prompt_dataset([good], tokenizer, config, response_budget=16)


def test_a_gkd_run_scores_every_log_prob_with_the_kernel_its_update_uses(tmp_path):
    """GKD's update forward takes K targets per row, which only the torch op computes: every log-prob pass of the
    run uses it then, so the PPO ratio and the step-0 checks compare one kernel with itself (Triton on GPU
    otherwise)."""
    from megarlhf.learner.update import logprob_backend

    assert logprob_backend(_config(tmp_path, "algorithm.distill={loss: gkd, top_k: 4}")) == "torch"
    assert logprob_backend(_config(tmp_path)) == "auto"  # reverse_kl: sampled tokens only
