"""Preference steps in one (TP, CP, PP) layout against HF transformers written out by hand.
Usage: _worker_preference.py TP CP PP MODEL_DIR RM_DIR OUT_DIR

Six pairs (prompt 2..7 tokens, responses 1..11, chosen and rejected of unequal lengths) with the
reference's summed log-probs fixed (HF's plus noise), the same in every layout; with DP=2 each rank takes
every other pair. Records, on every rank:

* ``dpo``, ``ipo``, ``simpo``: one ``preference_step`` (loss, gradient norm, metrics) of a fresh actor, and
  the same loss computed by hand on HF's causal LM (log_softmax of the full logits), its gradient norm and
  the largest relative gradient difference per HF tensor (1 rank only: the gradients of a whole model);
* ``rm``: one ``reward_model_step`` of the value-head model and HF's by hand (scores at the last token,
  ``-logsigmoid(s_w - s_l)``), and ``compute_scores`` vs HF's scores of the trained model after the step;
* ``kto``: one ``preference_step`` on KTO of six unpaired examples (the pairs' chosen sides, mixed labels)
  with their KL rows (each prompt + the previous example's completion), against KTO by hand on HF's model
  (the KL baseline from HF's log-probs of the KL rows), and the rows for the TRL comparison;
* ``export`` (1 rank): the trained reward model exported and reloaded as HF ...ForSequenceClassification,
  its pooled logits (right-padded batch, pad id set) vs ``compute_scores``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

sys.path.insert(0, str(Path(__file__).parent))
from _batch import VOCAB, noise, run_config  # noqa: E402
from _worker_single import megatron_grads, norm  # noqa: E402

PROMPTS = (5, 3, 7, 4, 2, 6)
CHOSEN = (9, 1, 4, 11, 7, 3)
REJECTED = (6, 10, 4, 2, 8, 5)
PAD = VOCAB - 1  # never a token of the pairs: HF's sequence classifier pools at the last non-pad token
# check name -> (registered loss, its parameters); dpo_plain (no label smoothing) is the loss TRL computes
LOSSES = {"dpo": ("dpo", {"beta": 0.1, "label_smoothing": 0.1}), "ipo": ("ipo", {"beta": 0.5}),
          "simpo": ("simpo", {"simpo_gamma": 0.5}), "dpo_plain": ("dpo", {"beta": 0.1})}


def pairs_batch():
    from megarlhf.data.preference import PreferencePair
    from megarlhf.learner.preference import pair_batch

    g = torch.Generator().manual_seed(0)
    pairs = []
    for i, (p, c, r) in enumerate(zip(PROMPTS, CHOSEN, REJECTED)):
        prompt = torch.randint(0, PAD, (p,), generator=g).tolist()
        chosen, rejected = (torch.randint(0, PAD, (n,), generator=g).tolist() for n in (c, r))
        pairs.append(PreferencePair(i, p, prompt + chosen, [0] * p + [1] * c, prompt + rejected, [0] * p + [1] * r))
    return pair_batch(pairs, torch.device("cpu"), pad_id=PAD)


def hf_summed_logps(hf, batch) -> torch.Tensor:
    logp = torch.log_softmax(hf(input_ids=batch.input_ids).logits.float(), dim=-1)
    token = logp[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return (token * batch.response_mask[:, 1:]).sum(dim=1)


def hf_scores(rm, batch) -> torch.Tensor:
    hidden = rm.model(input_ids=batch.input_ids).last_hidden_state
    last = hidden[torch.arange(batch.batch_size), batch.lengths - 1]
    return last @ rm.score.weight[0]


def hand_loss(name: str, params: dict, logps: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor):
    """The loss of each pair written from the papers' formulas (not through the registry)."""
    w, l, rw, rl = logps[0::2], logps[1::2], ref[0::2], ref[1::2]
    nw, nl = lengths[0::2].double(), lengths[1::2].double()
    if name == "dpo":
        z, eps = params["beta"] * ((w - rw) - (l - rl)), params.get("label_smoothing", 0.0)
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if name == "ipo":
        return ((w - rw) / nw - (l - rl) / nl - 1 / (2 * params["beta"])) ** 2
    return -F.logsigmoid(2.0 * w / nw - 2.0 * l / nl - params["simpo_gamma"])


def max_rel_grad(megatron: dict, hf_model) -> float:
    worst = 0.0
    for name, p in hf_model.named_parameters():
        ours = megatron[name][: p.grad.shape[0]]  # padded vocabulary rows carry no gradient
        worst = max(worst, float((ours - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)))
    return worst


def policy_checks(check, cfg, runtime, full, local, ref, single: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from megarlhf.config.preference import PreferenceLossConfig
    from megarlhf.learner import build_actor
    from megarlhf.learner.preference import preference_step

    name, params = LOSSES[check]
    cfg.preference.loss = name
    cfg.preference.params = PreferenceLossConfig(**params)
    actor = build_actor(cfg, runtime)
    rows = local_rows(full, runtime)
    metrics = preference_step(actor, local, cfg, ref[rows] if name != "simpo" else None)
    result = {"loss": metrics["dpo/loss"], "grad_norm": metrics["dpo/grad_norm"],
              "accuracy": metrics["rewards/accuracy"], "margin": metrics["rewards/margin"]}
    hf = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    logps = hf_summed_logps(hf, full).double()
    loss = hand_loss(name, params, logps, ref.double(), full.response_mask.sum(dim=1)).mean()
    loss.backward()
    result.update(hf_loss=float(loss), hf_grad_norm=norm([p.grad for p in hf.parameters()]))
    if single:
        result["grad_max_rel"] = max_rel_grad(megatron_grads(actor, "lm"), hf)
    return result


def reward_model_checks(cfg, runtime, full, local, single: bool, out_dir: str) -> dict:
    from transformers import AutoModelForSequenceClassification

    from megarlhf.learner import build_reward_model
    from megarlhf.learner.preference import compute_scores, reward_model_step
    from model_providers.value_head import export_reward_model

    rm_dir = cfg.model.critic_path
    model = build_reward_model(cfg, runtime, rm_dir)
    metrics = reward_model_step(model, local, cfg)
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    scores = hf_scores(hf, full).double()
    loss = -F.logsigmoid(scores[0::2] - scores[1::2]).mean()
    loss.backward()
    result = {"loss": metrics["rm/loss"], "accuracy": metrics["rm/accuracy"], "grad_norm": metrics["rm/grad_norm"],
              "hf_loss": float(loss), "hf_accuracy": float((scores[0::2] > scores[1::2]).double().mean()),
              "hf_grad_norm": norm([p.grad for p in hf.parameters()])}
    if single:
        result["grad_max_rel"] = max_rel_grad(megatron_grads(model, "value"), hf)
    trained = compute_scores(model, local, cfg)
    export = export_reward_model(model.model, model.provider, Path(out_dir) / "rm_export", source_dir=rm_dir,
                                 overwrite=True)
    exported = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32)
    exported.config.pad_token_id = PAD
    with torch.no_grad():
        attention = torch.arange(full.input_ids.shape[1])[None] < full.lengths[:, None]
        pooled = exported(input_ids=full.input_ids, attention_mask=attention.long()).logits[:, 0]
    result["export_score_max_diff"] = float((trained - pooled[local_rows(full, runtime)]).abs().max())
    result["export_score_scale"] = float(pooled.abs().max())
    result.update(learned_reward_checks(cfg, runtime, export, full, local, pooled))
    return result


def learned_reward_checks(cfg, runtime, export: Path, full, local, pooled) -> dict:
    """The exported model as the RL loop's learned reward: this rank's samples scored, standardised with
    the stored statistics and clipped, vs HF's pooled logits put through the same formula by hand."""
    import json

    from megarlhf.config.reward import RewardConfig
    from megarlhf.rewards import RewardInput
    from megarlhf.learner.learned_reward import STATS_FILE, LearnedReward
    from megarlhf.learner import build_reward_model

    mean, std, clip = 1.5, 8.0, 2.5
    if runtime.launch.rank == 0:
        (export / STATS_FILE).write_text(json.dumps({"mean": mean, "std": std}))
    torch.distributed.barrier()
    reward = RewardConfig(functions=[], reward_model_path=str(export), reward_model_normalize=True,
                          reward_model_clip=clip)
    frozen = build_reward_model(cfg, runtime, str(export), trainable=False)
    rows = local_rows(full, runtime).tolist()
    samples = [RewardInput(prompt="", response="", prompt_ids=tuple(local.input_ids[i, :PROMPTS[r // 2]].tolist()),
                           response_ids=tuple(local.input_ids[i, PROMPTS[r // 2]:local.lengths[i]].tolist()))
               for i, r in enumerate(rows)]
    scores = torch.tensor(LearnedReward(frozen, cfg, reward)(samples), dtype=torch.float64)
    expected = ((pooled[rows].double() - mean) / std).clamp(-clip, clip)
    return {"learned_max_diff": float((scores - expected).abs().max()),
            "learned_clipped": int((expected.abs() == clip).sum())}


KTO_LABELS = (True, False, True, True, False, False)
KTO_PARAMS = {"beta": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.5}


def kto_batch(full):
    """Six unpaired examples (prompt + the pair's chosen side) and their KL rows, as a pair batch."""
    from megarlhf.data.preference import UnpairedExample
    from megarlhf.learner.preference import pair_batch

    sides = [full.input_ids[2 * i, :full.lengths[2 * i]].tolist() for i in range(len(PROMPTS))]
    examples = []
    for i, p in enumerate(PROMPTS):
        other = sides[i - 1][PROMPTS[i - 1]:]
        examples.append(UnpairedExample(i, p, sides[i], [0] * p + [1] * (len(sides[i]) - p), KTO_LABELS[i],
                                        sides[i][:p] + other, [0] * p + [1] * len(other)))
    return pair_batch(examples, torch.device("cpu"), pad_id=PAD)


def kto_checks(cfg, runtime, full, single: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from megarlhf.config.preference import PreferenceLossConfig
    from megarlhf.learner import build_actor
    from megarlhf.learner.preference import preference_step

    batch = kto_batch(full)
    hf = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    with torch.no_grad():  # the reference below the policy on average: a positive KL baseline
        ref = hf_summed_logps(hf, batch) - 0.6 + noise((batch.batch_size,), 8, 0.3)
    cfg.preference.loss = "kto"
    cfg.preference.params = PreferenceLossConfig(**KTO_PARAMS)
    actor = build_actor(cfg, runtime)
    rows = local_rows(batch, runtime)
    labels = torch.tensor(KTO_LABELS)
    metrics = preference_step(actor, batch.select(rows), cfg, ref[rows], desirable=labels[rows[0::2] // 2])
    logps = hf_summed_logps(hf, batch).double()
    z0 = (logps[1::2].detach() - ref[1::2].double()).mean().clamp(min=0)
    rho = logps[0::2] - ref[0::2].double()
    beta, w_d, w_u = KTO_PARAMS["beta"], KTO_PARAMS["desirable_weight"], KTO_PARAMS["undesirable_weight"]
    loss = torch.where(labels, w_d * (1 - torch.sigmoid(beta * (rho - z0))),
                       w_u * (1 - torch.sigmoid(beta * (z0 - rho)))).mean()
    loss.backward()
    result = {"loss": metrics["dpo/loss"], "grad_norm": metrics["dpo/grad_norm"], "kl": metrics["kto/kl"],
              "chosen": metrics["rewards/chosen"], "rejected": metrics["rewards/rejected"],
              "hf_loss": float(loss), "hf_kl": float(z0), "hf_grad_norm": norm([p.grad for p in hf.parameters()]),
              "hf_chosen": float(beta * rho[labels].mean()), "hf_rejected": float(beta * rho[~labels].mean()),
              "rows": {"input_ids": batch.input_ids.tolist(), "lengths": batch.lengths.tolist(),
                       "prompt_lengths": list(PROMPTS), "labels": list(KTO_LABELS), "ref_logps": ref.tolist()}}
    if single:
        result["grad_max_rel"] = max_rel_grad(megatron_grads(actor, "lm"), hf)
    return result


def local_rows(full, runtime) -> torch.Tensor:
    pairs = torch.arange(full.batch_size // 2)[runtime.dp.rank::runtime.dp.size]
    return torch.stack([2 * pairs, 2 * pairs + 1], dim=1).flatten()


def main() -> None:
    tp, cp, pp = (int(x) for x in sys.argv[1:4])
    model_dir, rm_dir, out_dir = sys.argv[4:7]
    runtime = init_parallel(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                           context_parallel_size=cp))
    from transformers import AutoModelForCausalLM

    single = runtime.world.size == 1
    cfg = run_config(model_dir, rm_dir)
    full = pairs_batch()
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ref = hf_summed_logps(hf, full) + noise((full.batch_size,), 7, 2.0)
    local = full.select(local_rows(full, runtime))
    result = {check: policy_checks(check, cfg, runtime, full, local, ref, single) for check in LOSSES}
    result["pairs"] = {"input_ids": full.input_ids.tolist(), "lengths": full.lengths.tolist(),
                       "prompt_lengths": list(PROMPTS), "ref_logps": ref.tolist()}
    result["kto"] = kto_checks(cfg, runtime, full, single)
    result["rm"] = reward_model_checks(cfg, runtime, full, local, single, out_dir)
    write_rank_result(out_dir, runtime.launch.rank, result)


if __name__ == "__main__":
    main()
