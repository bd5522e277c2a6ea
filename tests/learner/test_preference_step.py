"""DPO / IPO / SimPO and reward-model steps against HF transformers written out by hand, and the same
steps in every 2-rank layout (DP, TP, CP, PP): the loss and gradient do not depend on how the pairs are
split. The reward model exported by megarlhf is HF's ...ForSequenceClassification scoring the same numbers.
"""
from pathlib import Path

import pytest

from megarlhf.testing.launch import read_rank_results, run_torchrun

HERE = Path(__file__).parent
LOSSES = ("dpo", "ipo", "simpo", "dpo_plain", "rm")


@pytest.fixture(scope="module")
def preference_run(tiny_dirs, tmp_path_factory):
    cache: dict[tuple, list[dict]] = {}

    def run(nproc: int, layout: tuple[int, int, int]) -> list[dict]:
        if (nproc, layout) not in cache:
            out = tmp_path_factory.mktemp("preference")
            run_torchrun(HERE / "_worker_preference.py", nproc,
                         [str(x) for x in layout] + [str(tiny_dirs[0]), str(tiny_dirs[1]), str(out)], timeout_s=600)
            cache[nproc, layout] = read_rank_results(out, nproc)
        return cache[nproc, layout]

    return run


@pytest.mark.parametrize("loss", LOSSES)
def test_step_matches_hf_by_hand(preference_run, loss):
    got = preference_run(1, (1, 1, 1))[0][loss]
    assert got["loss"] == pytest.approx(got["hf_loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(got["hf_grad_norm"], rel=1e-5)
    assert got["grad_max_rel"] < 1e-5  # every HF tensor's gradient, through the weight mapping
    if loss == "rm":
        assert got["accuracy"] == got["hf_accuracy"]


def test_kto_step_matches_hf_by_hand(preference_run):
    got = preference_run(1, (1, 1, 1))[0]["kto"]
    assert got["hf_kl"] > 0.1  # the baseline is not clamped to 0 here: its value is checked
    assert abs(got["kl"] - got["hf_kl"]) < 1e-5  # a mean of differences of ~-40 summed fp32 log-probs
    assert got["loss"] == pytest.approx(got["hf_loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(got["hf_grad_norm"], rel=1e-5)
    assert got["grad_max_rel"] < 1e-5
    # beta x (a ~-40 sum of fp32 log-probs minus the reference's): one ulp of the sums is ~4e-7 after beta
    assert (got["chosen"], got["rejected"]) == pytest.approx((got["hf_chosen"], got["hf_rejected"]), rel=1e-6, abs=2e-6)


def test_exported_reward_model_scores_as_hf_sequence_classifier(preference_run):
    got = preference_run(1, (1, 1, 1))[0]["rm"]
    assert got["export_score_max_diff"] <= 1e-6 * got["export_score_scale"] + 1e-5


def test_learned_reward_scores_standardises_and_clips_like_hf(preference_run):
    got = preference_run(1, (1, 1, 1))[0]["rm"]
    assert got["learned_max_diff"] < 1e-5
    assert 0 < got["learned_clipped"] < 12  # the clip is exercised on some samples, not all


@pytest.mark.parametrize("layout", [(1, 1, 1), pytest.param((2, 1, 1), marks=pytest.mark.slow),  # ~20 s each
                                    pytest.param((1, 2, 1), marks=pytest.mark.slow),
                                    pytest.param((1, 1, 2), marks=pytest.mark.slow)], ids=["dp2", "tp2", "cp2", "pp2"])
def test_layouts_give_the_single_rank_step(preference_run, layout):
    single = preference_run(1, (1, 1, 1))[0]
    for rank in preference_run(2, layout):
        for loss in LOSSES:
            assert rank[loss]["loss"] == pytest.approx(single[loss]["loss"], rel=2e-6), loss
            assert rank[loss]["grad_norm"] == pytest.approx(single[loss]["grad_norm"], rel=2e-6), loss
            assert rank[loss]["accuracy"] == single[loss]["accuracy"], loss
        for key in ("loss", "grad_norm", "chosen", "rejected"):
            assert rank["kto"][key] == pytest.approx(single["kto"][key], rel=2e-6), key
        assert abs(rank["kto"]["kl"] - single["kto"]["kl"]) < 1e-5  # a global mean over every rank's KL rows
        assert rank["rm"]["export_score_max_diff"] <= 1e-6 * rank["rm"]["export_score_scale"] + 1e-5
        assert rank["rm"]["learned_max_diff"] < 1e-5


def test_dpo_step_matches_trl_dpo_trainer(preference_run, tiny_dirs, tmp_path):
    """TRL's DPOTrainer (sigmoid loss, precomputed reference log-probs) on HF's model, fed the same token
    ids through its own collator: the same loss and gradient norm as megarlhf's Megatron DPO step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    result = preference_run(1, (1, 1, 1))[0]
    pairs, ours = result["pairs"], result["dpo_plain"]
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[0], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[0])
    args = DPOConfig(output_dir=str(tmp_path), beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=True,
                     report_to=[], use_cpu=True, max_length=None)
    placeholder = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # the trainer needs one
    trainer = DPOTrainer(model=model, args=args, train_dataset=placeholder, processing_class=tokenizer)
    ids, lengths = pairs["input_ids"], pairs["lengths"]
    examples = []
    for k, p in enumerate(pairs["prompt_lengths"]):
        chosen, rejected = ids[2 * k][:lengths[2 * k]], ids[2 * k + 1][:lengths[2 * k + 1]]
        examples.append({"prompt_ids": chosen[:p], "chosen_ids": chosen[p:], "rejected_ids": rejected[p:]})
    inputs = trainer.data_collator(examples)
    ref = torch.tensor(pairs["ref_logps"])
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref[0::2], ref[1::2]
    model.train()
    loss = trainer._compute_loss(model, inputs, False)
    loss.backward()
    grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))
    loss = float(loss.detach())
    assert abs(loss - ours["loss"]) < 1e-6
    assert grad_norm == pytest.approx(ours["grad_norm"], rel=1e-5)
    print(f"TRL DPOTrainer vs megarlhf DPO step: |loss diff| = {abs(loss - ours['loss']):.2e}, "
          f"grad norm {grad_norm:.6f} vs {ours['grad_norm']:.6f}")


def test_kto_step_matches_trl_kto_trainer(preference_run, tiny_dirs, tmp_path):
    """TRL's KTOTrainer (loss_type kto, precomputed reference log-probs) on HF's model, fed the same
    prompts, completions, KL completions and labels through its own collator: the same loss, gradient
    norm and KL baseline as megarlhf's Megatron KTO step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    result = preference_run(1, (1, 1, 1))[0]["kto"]
    rows = result["rows"]
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[0], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[0])
    args = KTOConfig(output_dir=str(tmp_path), beta=0.5, desirable_weight=1.0, undesirable_weight=1.5,
                     precompute_ref_log_probs=True, report_to=[], use_cpu=True, max_length=None,
                     per_device_train_batch_size=6)
    placeholder = Dataset.from_list([{"prompt": "a", "completion": "b", "label": True},
                                     {"prompt": "c", "completion": "d", "label": False}])
    trainer = KTOTrainer(model=model, args=args, train_dataset=placeholder, processing_class=tokenizer)
    ids, lengths, ref = rows["input_ids"], rows["lengths"], rows["ref_logps"]
    examples = []
    for k, (p, label) in enumerate(zip(rows["prompt_lengths"], rows["labels"])):
        example, kl = ids[2 * k][:lengths[2 * k]], ids[2 * k + 1][:lengths[2 * k + 1]]
        assert example[:p] == kl[:p]
        examples.append({"prompt_ids": example[:p], "completion_ids": example[p:], "KL_completion_ids": kl[p:],
                         "label": label, "ref_logps": ref[2 * k], "ref_KL_logps": ref[2 * k + 1]})
    inputs = trainer.data_collator(examples)
    model.train()
    loss = trainer._compute_loss(model, inputs, False)
    loss.backward()
    grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))
    loss, kl = float(loss.detach()), trainer._metrics["train"]["kl"][-1]
    assert abs(loss - result["loss"]) < 1e-6
    assert grad_norm == pytest.approx(result["grad_norm"], rel=1e-5)
    assert kl == pytest.approx(result["kl"], rel=1e-5)
    print(f"TRL KTOTrainer vs megarlhf KTO step: |loss diff| = {abs(loss - result['loss']):.2e}, "
          f"grad norm {grad_norm:.6f} vs {result['grad_norm']:.6f}, kl {kl:.6f} vs {result['kl']:.6f}")
