"""Distillation through ``megarlhf train`` as users run it (torchrun, the CLI, a recipe):

* GKD against TRL 1.16's ``GKDTrainer`` on the same tiny student and teacher, data and settings (lmbda 0: the
  dataset's responses; beta 0, 0.5 and 1; 3 steps): the per-step losses agree, at DP 1 and in 2-rank layouts;
* on-policy distillation (the reverse-KL advantage) and GKD on the student's own samples in DP 2, TP 2 (the
  teacher scores at TP 2 as at TP 1), bf16, disaggregated engines, with a LoRA student, and with the teacher in
  a layout of its own (``teacher.parallel``: TP 2 or PP 2 beside a DP 2 student, DP 2 beside a TP 2 one, TP 2
  over the two trainer ranks of a disaggregated run): they run, the teacher's reverse KL falls, and the logged
  numbers are those of the formulas.
"""
import json
from pathlib import Path

import pytest
import torch

from megarlhf.config import RunConfig, load_config
from megarlhf.testing.launch import train_with_cli
from model_providers.tiny_models import make_tiny_model

PAIRS = [(a, b) for a in range(5) for b in range(5) if a + b < 10][:12]  # single-digit sums: one length


def _write_rows(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"{a} plus {b} is"},
                          {"role": "assistant", "content": f"{a + b}"}], "answer": str(a + b)} for a, b in PAIRS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny student and a teacher of the same architecture and tokenizer (another random init), and the
    data: 12 chat rows ending with the assistant's answer, every row the same number of tokens (TRL pads on
    the left without shifting positions, so equal lengths keep its logits unpadded ones)."""
    root = tmp_path_factory.mktemp("distill")
    student = make_tiny_model("qwen2", root / "student", seed=0)
    teacher = make_tiny_model("qwen2", root / "teacher", seed=7)
    return student, teacher, _write_rows(root / "train.jsonl")


GKD_RECIPE = """
model: {{path: {student}, dtype: float32}}
teacher: {{model_path: {teacher}}}
data: {{train_path: {data}, messages_key: messages, shuffle: false, max_prompt_length: 64}}
rollout: {{backend: hf, n_samples: 1, temperature: 1.0, max_new_tokens: 8}}
algorithm: {{estimator: none, kl_mode: none, distill: {{loss: gkd, top_k: 384, beta: {beta}, lmbda: 0.0}}}}
optim: {{lr: 1.0e-3, schedule: constant, weight_decay: 0.0, clip_grad: 1.0}}
train: {{steps: 3, global_batch_size: 4, micro_batch_tokens: 4096}}
reward: {{functions: []}}
logging: {{run_dir: {run}}}
"""


def _trl_gkd_losses(student: Path, teacher: Path, data: Path, beta: float, out: Path) -> list[float]:
    """TRL's GKDTrainer on the same models and rows: 3 steps of 4 rows in file order, lmbda 0, constant lr."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    args = GKDConfig(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=3,
                     learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     max_grad_norm=1.0, lmbda=0.0, beta=beta, temperature=1.0, seed=0, report_to=[], use_cpu=True,
                     logging_steps=1, save_strategy="no", train_sampling_strategy="sequential", bf16=False)
    tokenizer = AutoTokenizer.from_pretrained(student)
    trainer = GKDTrainer(model=AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
                         teacher_model=AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32), args=args,
                         train_dataset=Dataset.from_list([{"messages": r["messages"]} for r in rows]),
                         processing_class=tokenizer)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.fixture(scope="module")
def trl_losses(tiny_pair, tmp_path_factory):
    cache = {}

    def losses(beta: float) -> list[float]:
        if beta not in cache:
            cache[beta] = _trl_gkd_losses(*tiny_pair, beta, tmp_path_factory.mktemp("trl"))
        return cache[beta]

    return losses


def _run_gkd(tiny_pair, tmp_path: Path, beta: float, overrides: list[str], nproc: int) -> list[dict]:
    student, teacher, data = tiny_pair
    recipe = tmp_path / "gkd.yaml"
    recipe.write_text(GKD_RECIPE.format(student=student, teacher=teacher, data=data, beta=beta, run=tmp_path / "run"))
    samples, metrics = train_with_cli(recipe, tmp_path / "run", overrides, nproc=nproc)
    assert all(m["distill/on_policy"] == 0.0 for m in metrics)  # lmbda 0: every step trains on the dataset
    # the dataset's responses in file order: the assistant's answer and its end-of-turn tokens
    assert [s["response"] for s in samples] == [f"{a + b}<|im_end|>\n" for a, b in PAIRS]
    return metrics


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_equals_trl_gkd_trainer(tiny_pair, trl_losses, tmp_path, beta):
    ours = [m["actor/distill_loss"] for m in _run_gkd(tiny_pair, tmp_path, beta, [], nproc=1)]
    theirs = trl_losses(beta)
    print(f"beta {beta}: megarlhf {ours} TRL {theirs}")
    assert len(ours) == len(theirs) == 3
    assert ours[0] > 0.05  # the two random models disagree: a divergence worth matching
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5


@pytest.mark.parametrize("layout", [["parallel.tensor_model_parallel_size=2"],
                                    pytest.param([], marks=pytest.mark.slow),
                                    pytest.param(["parallel.pipeline_model_parallel_size=2"], marks=pytest.mark.slow),
                                    pytest.param(["parallel.context_parallel_size=2"], marks=pytest.mark.slow),
                                    pytest.param(["rollout.placement={mode: disaggregated, num_engine_ranks: 1}"],
                                                 marks=pytest.mark.slow)],
                         ids=["tp2", "dp2", "pp2", "cp2", "disaggregated"])
def test_gkd_equals_trl_in_two_rank_layouts(tiny_pair, trl_losses, tmp_path, layout):
    ours = [m["actor/distill_loss"] for m in _run_gkd(tiny_pair, tmp_path, 0.5, layout, nproc=2)]
    assert max(abs(a - b) for a, b in zip(ours, trl_losses(0.5))) <= 1e-5


OPD_RECIPE = """
model: {{path: {student}, dtype: float32}}
teacher: {{model_path: {teacher}}}
data: {{train_path: {data}, messages_key: messages, max_prompt_length: 64}}
rollout: {{backend: hf, n_samples: 2, temperature: 1.0, max_new_tokens: 8}}
algorithm: {{estimator: none, kl_mode: none, distill: {{loss: reverse_kl}}}}
optim: {{lr: 1.0e-3}}
train: {{steps: 4, global_batch_size: 4, micro_batch_tokens: 4096}}
reward: {{functions: [{{name: exact_match}}]}}
logging: {{run_dir: {run}, samples_per_step: 8}}
"""

OPD_LAYOUTS = {"dp2": [], "tp2": ["parallel.tensor_model_parallel_size=2"],
               "disaggregated_bf16": ["rollout.placement={mode: disaggregated, num_engine_ranks: 1}",
                                      "model.dtype=bfloat16", "teacher.dtype=bfloat16"],
               "lora_dp2": ["model.lora={rank: 4, alpha: 8.0}", "optim.lr=1.0e-2"],
               "gkd_on_policy_dp2": ["algorithm.distill={loss: gkd, top_k: 16, beta: 0.5}"],
               "gkd_on_policy_pp2": ["algorithm.distill={loss: gkd, top_k: 16, beta: 0.5}",
                                     "parallel.pipeline_model_parallel_size=2"],
               "gkd_on_policy_cp2": ["algorithm.distill={loss: gkd, top_k: 16, beta: 0.5}",
                                     "parallel.context_parallel_size=2"],
               # the teacher in a layout of its own (teacher.parallel) over the same trainer ranks
               # (the gathered optimizer format uses the run's gloo groups, which the teacher's layout must leave)
               "teacher_tp2_dp2": ["teacher.parallel={tensor_model_parallel_size: 2}",
                                   "checkpoint.optimizer_format=fully_reshardable"],
               "gkd_teacher_pp2_dp2": ["algorithm.distill={loss: gkd, top_k: 16, beta: 0.5}",
                                       "teacher.parallel={pipeline_model_parallel_size: 2}"],
               "teacher_dp2_tp2": ["parallel.tensor_model_parallel_size=2", "teacher.parallel={}"],
               "disaggregated_teacher_tp2": ["rollout.placement={mode: disaggregated, num_engine_ranks: 1}",
                                             "teacher.parallel={tensor_model_parallel_size: 2}"]}
SLOW_LAYOUTS = ("lora_dp2", "tp2", "gkd_on_policy_pp2", "gkd_on_policy_cp2", "teacher_dp2_tp2",
                "disaggregated_teacher_tp2")
FP32_LAYOUTS = ("dp2", "tp2", "gkd_on_policy_pp2", "gkd_on_policy_cp2", "teacher_tp2_dp2", "gkd_teacher_pp2_dp2",
                "teacher_dp2_tp2", "disaggregated_teacher_tp2")  # one replica or two, the single-rank run's samples
RANKS = {"disaggregated_teacher_tp2": 3}  # two trainer ranks and an engine rank


def _run_opd(tiny_pair, tmp_path: Path, overrides: list[str], nproc: int) -> tuple[list[dict], list[dict]]:
    student, teacher, data = tiny_pair
    recipe = tmp_path / "opd.yaml"
    recipe.write_text(OPD_RECIPE.format(student=student, teacher=teacher, data=data, run=tmp_path / "run"))
    return train_with_cli(recipe, tmp_path / "run", overrides, nproc=nproc)


@pytest.fixture(scope="module")
def single_rank_opd(tiny_pair, tmp_path_factory):
    return _run_opd(tiny_pair, tmp_path_factory.mktemp("opd1"), [], nproc=1)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LAYOUTS else name
                                    for name in OPD_LAYOUTS])
def test_on_policy_distillation_in_layouts(tiny_pair, single_rank_opd, tmp_path, layout):
    """The student's own samples, scored by the teacher, in the layouts users run. At step 0 (nothing trained yet,
    the same samples) the teacher's reverse KL is the single-rank run's: the teacher scores the same tokens at TP 2
    and DP 2 as at TP 1 (fp32: <= 1e-5), in the student's layout or in its own (``teacher.parallel``). The reverse-KL advantage is t - s, so with one update per step the
    policy loss at step 0 is mean(s - t), the reverse KL itself; the KL falls as the student learns."""
    samples, metrics = _run_opd(tiny_pair, tmp_path, OPD_LAYOUTS[layout], nproc=RANKS.get(layout, 2))
    single_samples, single = single_rank_opd
    assert len(metrics) == 4 and all("distill/reverse_kl" in m for m in metrics)
    kl = [m["distill/reverse_kl"] for m in metrics]
    if "teacher.parallel" in " ".join(OPD_LAYOUTS[layout]):  # the run read the teacher's own layout
        assert load_config(RunConfig, tmp_path / "run" / "config.yaml").teacher.parallel is not None
    if layout in FP32_LAYOUTS:
        assert [s["response"] for s in samples[:8]] == [s["response"] for s in single_samples[:8]]
        assert abs(kl[0] - single[0]["distill/reverse_kl"]) <= 1e-5
    if not layout.startswith("gkd"):
        assert metrics[0]["actor/pg_loss"] == pytest.approx(kl[0], abs=1e-5 if "bf16" not in layout else 2e-2)
    else:
        assert metrics[0]["actor/pg_loss"] == 0.0 and metrics[-1]["actor/distill_loss"] < metrics[0]["actor/distill_loss"]
    assert kl[-1] < kl[0] - 0.02, kl


def test_single_rank_on_policy_distillation_learns(single_rank_opd):
    _, metrics = single_rank_opd
    kl = [m["distill/reverse_kl"] for m in metrics]
    assert metrics[0]["actor/pg_loss"] == pytest.approx(kl[0], abs=1e-6)  # mean(-(t - s)) at ratio 1
    assert kl[-1] < kl[0] - 0.02, kl
    assert all("reward/exact_match/mean" in m for m in metrics)  # the verifier still watches (estimator none)


@pytest.mark.slow
def test_a_distillation_run_stopped_and_resumed_equals_the_uninterrupted_one(tiny_pair, tmp_path):
    """GKD with lmbda 0.5 (which steps train on the student's samples is drawn from the seed and the step) for 4
    steps, against the same recipe stopped after 2 and resumed from its checkpoint: the same steps on dataset
    responses, the same samples, the same losses to the last bit (the teacher is rebuilt from its path)."""
    student, teacher, data = tiny_pair
    recipe = tmp_path / "gkd.yaml"
    recipe.write_text(GKD_RECIPE.format(student=student, teacher=teacher, data=data, beta=0.5, run="unused"))
    common = ["algorithm.distill.lmbda=0.5", "train.steps=4", "checkpoint.every=1", "rollout.n_samples=2"]
    whole, whole_metrics = train_with_cli(recipe, tmp_path / "whole", [*common, f"logging.run_dir={tmp_path}/whole"])
    train_with_cli(recipe, tmp_path / "cut", [*common, "train.steps=2", f"logging.run_dir={tmp_path}/cut"])
    resumed, resumed_metrics = train_with_cli(recipe, tmp_path / "cut", [*common, f"logging.run_dir={tmp_path}/cut",
                                                                         "checkpoint.resume=auto"])
    assert sorted({m["distill/on_policy"] for m in whole_metrics}) == [0.0, 1.0]  # both kinds of step
    for key in ("distill/on_policy", "actor/distill_loss", "actor/grad_norm"):
        assert [m[key] for m in resumed_metrics] == [m[key] for m in whole_metrics], key
    assert [(s["step"], s["response"]) for s in resumed] == [(s["step"], s["response"]) for s in whole]
