"""GPU check: the round's new training paths on CUDA in bf16 -- a DPO step, a KTO step and a
reward-model step against the same losses written out on HF transformers in fp32, RL against a learned
reward through the driver, rejection sampling and online DPO rounds through their driver, and multi-turn
tool rollouts through the driver (a scripted tool answers every turn) passing the step-0 gate with the
observation tokens masked."""
import pytest
import torch
import torch.nn.functional as F

from _gpu_common import run_config, run_rl

PROMPT, CHOSEN, REJECTED = (6, 9, 4, 7), (12, 5, 9, 3), (7, 11, 6, 8)


def _pairs(vocab: int, device):
    from megarlhf.data.preference import PreferencePair
    from megarlhf.learner.preference import pair_batch

    gen = torch.Generator().manual_seed(0)
    pairs = []
    for i, (p, c, r) in enumerate(zip(PROMPT, CHOSEN, REJECTED)):
        prompt = torch.randint(0, vocab, (p,), generator=gen).tolist()
        chosen, rejected = (torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (c, r))
        pairs.append(PreferencePair(i, p, prompt + chosen, [0] * p + [1] * c, prompt + rejected, [0] * p + [1] * r))
    return pair_batch(pairs, device)


def _hf_summed_logps(model_dir, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, mask = batch.input_ids.cpu(), batch.response_mask.cpu()
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits, dim=-1)
    return (logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]).sum(dim=1).double()


def _reward_model_dir(tiny_llama, out):
    """tiny_llama as an HF ...ForSequenceClassification with a seeded score head, and its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_llama, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        rm.score.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(2))
    rm.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(out)
    return out, rm


@pytest.mark.gpu
def test_dpo_and_reward_model_steps_bf16(runtime, tiny_llama, tmp_path, report):
    from megarlhf.learner import build_actor, build_reward_model
    from megarlhf.learner.preference import preference_step, reward_model_step

    config = run_config(tiny_llama, "bfloat16", "optim.clip_grad=0.0")
    batch = _pairs(384, runtime.device)
    logps = _hf_summed_logps(tiny_llama, batch)
    # reference log-probs 8 nats from the policy's, so margins stand well above bf16's error in summed
    # log-probs; checked: the loss (rel 3e-2) and the mean reward margin beta * (...) (rel 1e-1), which is
    # linear in beta. With 0.5 nats and the loss alone, beta x2 and beta / 2 moved the loss by 1-2% (fp32,
    # HF numbers): inside the tolerance.
    ref = (logps + 8.0 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    beta = config.preference.params.beta

    def loss_and_margin(beta_used, reference):
        margins = beta_used * ((logps[0::2] - reference[0::2]) - (logps[1::2] - reference[1::2]))
        return float(-F.logsigmoid(margins).mean()), float(margins.mean())

    expected, margin = loss_and_margin(beta, ref)
    faults = {"beta x2": loss_and_margin(2 * beta, ref), "beta / 2": loss_and_margin(beta / 2, ref),
              "no reference": loss_and_margin(beta, torch.zeros_like(ref))}
    # the check's power: every fault lies outside three times a tolerance
    assert all(abs(loss - expected) > 3 * 3e-2 * expected or abs(m - margin) > 3 * 1e-1 * abs(margin)
               for loss, m in faults.values()), (expected, margin, faults)
    dpo = preference_step(build_actor(config, runtime), batch, config, ref.float().to(runtime.device))
    report("DPO step bf16: loss, margin vs HF fp32",
           f"{dpo['dpo/loss']:.4f}/{expected:.4f}, {dpo['rewards/margin']:.4f}/{margin:.4f}", "",
           f"grad norm {dpo['dpo/grad_norm']:.3f}")
    assert dpo["dpo/loss"] == pytest.approx(expected, rel=3e-2)
    assert dpo["rewards/margin"] == pytest.approx(margin, rel=1e-1)
    rm_dir, hf_rm = _reward_model_dir(tiny_llama, tmp_path / "rm")
    with torch.no_grad():  # the score at each row's last token, fp32 on the host
        hidden = hf_rm.model(input_ids=batch.input_ids.cpu()).last_hidden_state
        scores = (hidden[torch.arange(batch.batch_size), batch.lengths.cpu() - 1] @ hf_rm.score.weight[0]).double()
    expected = -F.logsigmoid(scores[0::2] - scores[1::2]).mean()
    rm = reward_model_step(build_reward_model(config, runtime, str(rm_dir)), batch, config)
    report("reward-model step bf16: loss vs HF fp32", f"{rm['rm/loss']:.4f}/{float(expected):.4f}", "",
           f"accuracy {rm['rm/accuracy']:.2f}")
    assert rm["rm/loss"] == pytest.approx(float(expected), rel=3e-2)


@pytest.mark.gpu
def test_kto_step_bf16(runtime, tiny_llama, report):
    from megarlhf.data.preference import UnpairedExample
    from megarlhf.learner import build_actor
    from megarlhf.learner.preference import pair_batch, preference_step

    config = run_config(tiny_llama, "bfloat16", "optim.clip_grad=0.0", "preference.loss=kto")
    pairs = _pairs(384, torch.device("cpu"))
    sides = [pairs.input_ids[2 * i, :int(pairs.lengths[2 * i])].tolist() for i in range(len(PROMPT))]
    labels = [True, False, True, False]
    examples = [UnpairedExample(i, p, sides[i], [0] * p + [1] * (len(sides[i]) - p), labels[i],
                                sides[i][:p] + sides[i - 1][PROMPT[i - 1]:],
                                [0] * p + [1] * (len(sides[i - 1]) - PROMPT[i - 1])) for i, p in enumerate(PROMPT)]
    batch = pair_batch(examples, runtime.device)
    logps = _hf_summed_logps(tiny_llama, batch)
    ref = logps - 0.5 + 0.2 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    beta, good = config.preference.params.beta, torch.tensor(labels)
    z0 = (logps[1::2] - ref[1::2]).mean().clamp(min=0)
    rho = logps[0::2] - ref[0::2]
    expected = torch.where(good, 1 - torch.sigmoid(beta * (rho - z0)), 1 - torch.sigmoid(beta * (z0 - rho))).mean()
    kto = preference_step(build_actor(config, runtime), batch, config, ref.float().to(runtime.device),
                          desirable=good.to(runtime.device))
    report("KTO step bf16: loss, KL baseline vs HF fp32", f"{kto['dpo/loss']:.4f}/{float(expected):.4f}", "",
           f"z0 {kto['kto/kl']:.3f}/{float(z0):.3f}")
    assert kto["dpo/loss"] == pytest.approx(float(expected), rel=3e-2)
    assert kto["kto/kl"] == pytest.approx(float(z0), abs=0.05 * max(float(z0), 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["rs", "online-dpo"])
def test_rejection_sampling_and_online_dpo_rounds_bf16(runtime, tiny_llama, task, tmp_path, report, mode):
    from megarlhf.config import RunConfig, load_config
    from megarlhf.records.metrics import read_metrics
    from megarlhf.loops.iterative import train_iterative

    config = load_config(RunConfig, None, [
        f"model.path={tiny_llama}", "model.dtype=bfloat16", f"data.train_path={task / 'train.jsonl'}",
        "data.chat_template=never", "data.max_prompt_length=96", "rollout.backend=hf", "rollout.n_samples=4",
        "rollout.max_new_tokens=32", "train.steps=2", "train.global_batch_size=8", "train.micro_batch_tokens=2048",
        "optim.lr=1e-4", "reward.functions=[{name: exact_match}]", "checkpoint.every=0",
        f"logging.run_dir={tmp_path / 'run'}", "logging.backends=[]", "iterative.keep_truncated=true",
        "iterative.rs_threshold=null"])
    train_iterative(config, mode)
    rounds = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    key = "rs/kept" if mode == "rs" else "odpo/pairs"
    report(f"{mode} rounds bf16 (HF engine): {key} per round", " ".join(f"{r[key]:g}" for r in rounds), "", "")
    assert [r["step"] for r in rounds] == [0, 1]
    if mode == "rs":  # rs_threshold null: every prompt keeps its best sample, and the round trains on them
        assert all(r["rs/kept"] == 8 and r["sft/loss"] > 0 for r in rounds)


@pytest.mark.gpu
def test_rl_against_a_learned_reward_bf16(runtime, tiny_llama, task, tmp_path, report):
    rm_dir, _ = _reward_model_dir(tiny_llama, tmp_path / "rm")
    records = run_rl(tiny_llama, task, tmp_path, "model.dtype=bfloat16", "reward.functions=[]",
                     f"reward.reward_model_path={rm_dir}", "eval.reward_functions=[{name: exact_match}]")
    steps = [r for r in records if r.get("actor/loss") is not None]
    report("GRPO bf16 vs learned reward: step-0 gap max", steps[0]["mismatch/step0_logprob_gap_max"], "nats",
           f"reward/mean {steps[0]['reward/mean']:.3f}")
    assert len(steps) == 3 and steps[0]["reward/std"] > 0


@pytest.mark.gpu
def test_multi_turn_rollouts_bf16(runtime, tiny_llama, task, tmp_path, report):
    from megarlhf.envs.api import ENVIRONMENTS, ParsedCall, StepResult, ToolSpec
    from megarlhf.envs.parsers import PARSERS

    class EveryTurn:
        stop_token_ids, special_marker_ids = (), ()

        def __init__(self, tools, tokenizer=None):
            pass

        def __call__(self, text):
            return ParsedCall("script", {})

    class Scripted:
        tools = [ToolSpec("script", "fixed text")]

        def __init__(self, metadata, **kwargs):
            pass

        def step(self, messages, call):
            return StepResult("observation: 2 + 2 = 4")

    if "gpu_every_turn" not in PARSERS:
        PARSERS.register("gpu_every_turn")(EveryTurn)
        ENVIRONMENTS.register("gpu_scripted")(Scripted)
    records = run_rl(tiny_llama, task, tmp_path, "model.dtype=bfloat16", "rollout.max_new_tokens=16",
                     "rollout.max_response_tokens=150",
                     "rollout.env={name: gpu_scripted, parser: gpu_every_turn, max_turns: 3, describe_tools: false}")
    step0 = [r for r in records if r.get("actor/loss") is not None][0]
    report("multi-turn bf16: step-0 gap max / turns per sample", f"{step0['mismatch/step0_logprob_gap_max']:.2e}/"
           f"{step0['tools/turns_mean']:.1f}", "", "observations masked")
    assert step0["tools/turns_mean"] == 3.0
