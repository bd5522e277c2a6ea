"""Single-rank checks of the training engine against HF transformers (fp32).
Usage: _worker_single.py MODEL_DIR CRITIC_DIR OUT_DIR

Records: forward log-probs packed (groups sharing their prompt) vs packed without sharing vs unpacked vs
HF log_softmax of the full logits; values vs the HF
ForSequenceClassification head; one actor update (GRPO advantages, ppo_clip, token TIS, k3 KL loss,
entropy bonus, token_mean, three unequal micro-batches) vs the same loss written out by hand on HF's
model, loss and every gradient; the same update with the old log-probs taken from the update's own
forward vs from a separate scoring pass; one critic update vs the clipped value loss by hand; the non-finite
gate (skip and abort); one SFT step vs HF cross-entropy on the response tokens.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

sys.path.insert(0, str(Path(__file__).parent))
from _batch import experience, hf_logprobs, hf_values, noise, run_config  # noqa: E402

TEMPERATURE = 0.8
RUNTIME = None  # set by main: the Runtime init_parallel returned


def norm(grads) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def megatron_grads(trainable, head: str) -> dict[str, torch.Tensor]:
    """The gradients of the DDP model as HF-named full tensors (through the weight mapping)."""
    from model_providers.hf_checkpoint import iter_hf_weights, unwrap

    module = unwrap(trainable.model)
    saved = {n: p.detach().clone() for n, p in module.named_parameters()}
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.main_grad)
    grads = {name: t.clone() for name, t in iter_hf_weights(module, trainable.provider, head=head)}
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(saved[n])
    return grads


def forward_checks(cfg, batch, hf) -> dict:
    from megarlhf.learner import build_actor, compute_logprobs
    from megarlhf.learner.step import micro_batches_for

    actor = build_actor(cfg, RUNTIME)
    ref_lp, ref_ent = hf_logprobs(hf, batch.input_ids, TEMPERATURE)
    mask = batch.response_mask
    packed, entropy = compute_logprobs(actor, batch, cfg, entropy=True)
    shared_mbs = micro_batches_for(batch.input_ids, batch.lengths, mask, cfg, RUNTIME)
    cfg.train.share_prompt_prefix = False
    plain = compute_logprobs(actor, batch, cfg)
    cfg.train.share_prompt_prefix = True
    cfg.train.packing = False
    unpacked = compute_logprobs(actor, batch, cfg)
    cfg.train.packing = True
    return {"bf16_mean_error": bf16_sharing_errors(cfg, batch, plain),
            "packed_vs_unpacked": float((packed - unpacked)[mask].abs().max()),
            "shared_vs_plain_packed": float((packed - plain)[mask].abs().max()),
            "tokens_saved_by_sharing": int(batch.lengths.sum()) - sum(mb.num_tokens for mb in shared_mbs),
            "packed_vs_hf": float((packed - ref_lp.detach())[mask].abs().max()),
            "entropy_vs_hf": float((entropy - ref_ent.detach())[mask].abs().max()),
            "outside_mask_zero": bool((packed[~mask] == 0).all())}


def bf16_sharing_errors(cfg, batch, fp32: torch.Tensor) -> dict:
    """Mean |bf16 log-prob - fp32 log-prob| on response tokens, with shared prompts and packed whole."""
    from megarlhf.learner import build_actor, compute_logprobs

    cfg16 = copy.deepcopy(cfg)
    cfg16.model.dtype = "bfloat16"
    actor = build_actor(cfg16, RUNTIME)
    errors = {}
    for share in (True, False):
        cfg16.train.share_prompt_prefix = share
        lp = compute_logprobs(actor, batch, cfg16)
        errors["shared" if share else "whole"] = float((lp - fp32)[batch.response_mask].abs().mean())
    return errors


def actor_checks(cfg, batch, hf) -> dict:
    from megarlhf.learner import Packing, actor_update, build_actor, build_micro_batches

    actor = build_actor(cfg, RUNTIME)
    lp0, _ = hf_logprobs(hf, batch.input_ids, TEMPERATURE)
    lp0 = lp0.detach()
    old = lp0 + noise(lp0.shape, 1, 0.15)
    batch = batch.replace(old_logprobs=old, ref_logprobs=lp0 + noise(lp0.shape, 2, 0.3),
                          rollout_logprobs=old + noise(lp0.shape, 3, 0.4))
    metrics = actor_update(actor, batch, cfg)
    # the same objective by hand on HF's model
    m = batch.response_mask
    lp, ent = hf_logprobs(hf, batch.input_ids, TEMPERATURE)
    adv = batch.advantages
    tis = torch.clamp(torch.exp(batch.old_logprobs - batch.rollout_logprobs), max=2.0)
    ratio = torch.exp(lp - batch.old_logprobs)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)) * tis
    d = lp - batch.ref_logprobs
    kl = 0.05 * (torch.exp(-d) - 1 + d)
    n = m.sum()
    loss = ((pg + kl - 0.01 * ent) * m).sum() / n
    loss.backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    mg = megatron_grads(actor, "lm")
    clipped = ((-adv * torch.clamp(ratio, 0.8, 1.2)) > (-adv * ratio)) & m
    return {
        "loss": [metrics["actor/loss"], float(loss)],
        "pg_loss": [metrics["actor/pg_loss"], float((pg * m).sum() / n)],
        "kl_loss": [metrics["actor/kl_loss"], float((kl * m).sum() / n)],
        "entropy": [metrics["actor/entropy"], float((ent * m).sum() / n)],
        "clip_fraction": [metrics["actor/clip_fraction"], float(clipped.sum() / n)],
        "grad_norm": [metrics["actor/grad_norm"], norm(hf_grads.values())],
        "grad_rel_diff": {name: rel(mg[name], hf_grads[name]) for name in hf_grads},
        "is_weight_mean": [metrics["mismatch/is_weight_mean"], float((tis * m).sum() / n)],
        "micro_batches": len(build_micro_batches(batch.input_ids, batch.lengths, m,
                                                 Packing(cfg.train.micro_batch_tokens))),
        "metric_names": sorted(metrics),
    }


def old_from_update_checks(cfg, batch, lp0) -> dict:
    """One actor update with old log-probs from a separate scoring pass vs from the update's forward
    (token TIS against noisy rollout log-probs, KL loss, entropy bonus): metrics and parameters after."""
    import copy

    from megarlhf.learner import actor_update, build_actor, compute_logprobs

    batch = batch.replace(ref_logprobs=lp0 + noise(lp0.shape, 2, 0.3), rollout_logprobs=lp0 + noise(lp0.shape, 3, 0.4))
    scored, fused = build_actor(cfg, RUNTIME), build_actor(cfg, RUNTIME)
    before = [p.detach().clone() for p in scored.model.parameters()]
    with_scoring = actor_update(scored, batch.replace(old_logprobs=compute_logprobs(scored, batch, cfg)), cfg)
    from_update = actor_update(fused, batch, cfg)
    pairs = list(zip(scored.model.parameters(), fused.model.parameters(), before))
    two_steps = copy.deepcopy(cfg)
    two_steps.train.mini_batches = 2
    try:
        actor_update(build_actor(two_steps, RUNTIME), batch, two_steps)
        refused = None
    except ValueError as error:
        refused = str(error)
    return {"metrics": {k: [from_update.get(k), v] for k, v in with_scoring.items()},
            "param_max_diff": max(float((a - b).abs().max()) for a, b, _ in pairs),
            "param_max_step": max(float((a - p0).abs().max()) for a, _, p0 in pairs),
            "two_mini_batches_refused": refused}


def critic_checks(cfg, batch, hf_rm) -> dict:
    from megarlhf.learner import build_critic, compute_values, critic_update

    critic = build_critic(cfg, RUNTIME)
    values_hf = hf_values(hf_rm, batch.input_ids)
    m = batch.response_mask
    values = compute_values(critic, batch, cfg)
    old = values_hf.detach() + noise(values.shape, 4, 0.3)
    batch = batch.replace(values=old, returns=batch.returns + noise(values.shape, 5, 0.2))
    metrics = critic_update(critic, batch, cfg)
    clipped = old + torch.clamp(values_hf - old, -0.2, 0.2)
    per_token = 0.5 * torch.maximum((values_hf - batch.returns) ** 2, (clipped - batch.returns) ** 2)
    loss = (per_token * m).sum() / m.sum()
    loss.backward()
    hf_grads = {name: p.grad for name, p in hf_rm.named_parameters()}
    mg = megatron_grads(critic, "value")
    return {"values_vs_hf": float((values - values_hf.detach())[m].abs().max()),
            "value_loss": [metrics["critic/value_loss"], float(loss)],
            "grad_norm": [metrics["critic/grad_norm"], norm(hf_grads.values())],
            "grad_rel_diff": {name: rel(mg[name], hf_grads[name]) for name in hf_grads}}


def state_snapshot(trainable) -> list[torch.Tensor]:
    """Every parameter and every optimizer-state tensor, cloned."""
    tensors = [p.detach().clone() for p in trainable.model.parameters()]
    for opt in trainable.optimizer.chained_optimizers:
        for state in opt.optimizer.state.values():
            tensors += [v.detach().clone() for v in state.values() if torch.is_tensor(v)]
    return tensors


def gate_checks(cfg, batch, lp0) -> dict:
    from megarlhf.learner import NonFiniteError, actor_update, build_actor

    actor = build_actor(cfg, RUNTIME)
    batch = batch.replace(old_logprobs=lp0, ref_logprobs=lp0)
    actor_update(actor, batch, cfg)  # a good step first, so there is optimizer state to protect
    before, steps_before = state_snapshot(actor), actor.scheduler.num_steps
    bad_adv = batch.advantages.clone()
    bad_adv[3, 10] = float("nan")
    skipped = actor_update(actor, batch.replace(advantages=bad_adv), cfg, on_nonfinite="skip")
    after = state_snapshot(actor)
    result = {"skip_metrics": {k: skipped[k] for k in ("actor/skipped_steps", "actor/grad_norm")},
              "skip_unchanged": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)),
              "skip_scheduler_unchanged": actor.scheduler.num_steps == steps_before,
              "state_tensors": len(before)}
    try:
        actor_update(actor, batch.replace(advantages=bad_adv), cfg, on_nonfinite="abort")
        result["abort_loss_message"] = None
    except NonFiniteError as error:
        result["abort_loss_message"] = str(error)
    norm = actor.model.module.decoder.final_layernorm.weight
    with torch.no_grad():
        saved = norm[5].item()
        norm[5] = float("inf")
    try:
        actor_update(actor, batch, cfg, on_nonfinite="abort")
        result["abort_param_message"] = None
    except NonFiniteError as error:
        result["abort_param_message"] = str(error)
    with torch.no_grad():
        norm[5] = saved
    final = state_snapshot(actor)
    result["abort_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, final))
    return result


def sft_checks(cfg, batch, hf) -> dict:
    from megarlhf.data.sft import SFTExample
    from megarlhf.learner import build_actor, sft_step

    actor = build_actor(cfg, RUNTIME)
    examples = [SFTExample(batch.input_ids[i, :n].tolist(), batch.response_mask[i, :n].int().tolist())
                for i, n in enumerate(batch.lengths.tolist())]
    metrics = sft_step(actor, examples, cfg)
    labels = torch.where(batch.response_mask, batch.input_ids, -100)[:, 1:]
    logits = hf(input_ids=batch.input_ids).logits.float()[:, :-1]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    return {"loss": [metrics["sft/loss"], float(loss)],
            "grad_norm": [metrics["sft/grad_norm"], norm(p.grad for p in hf.parameters())],
            "tokens": [metrics["sft/tokens"], int(batch.response_mask.sum())]}


def main() -> None:
    global RUNTIME
    model_dir, critic_dir, out_dir = sys.argv[1:4]
    RUNTIME = init_parallel(ParallelConfig())
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    def hf():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    cfg = run_config(model_dir, critic_dir)
    batch = experience()
    result = {"forward": forward_checks(cfg, batch, hf()), "actor": actor_checks(cfg, batch, hf())}
    lp0 = hf_logprobs(hf(), batch.input_ids, TEMPERATURE)[0].detach()
    result["gate"] = gate_checks(cfg, batch, lp0)
    result["old_from_update"] = old_from_update_checks(cfg, batch, lp0)
    cfg.rollout.temperature = 1.0
    result["sft"] = sft_checks(cfg, batch, hf())
    rm = AutoModelForSequenceClassification.from_pretrained(critic_dir, dtype=torch.float32)
    result["critic"] = critic_checks(cfg, batch, rm)
    write_rank_result(out_dir, 0, result)


if __name__ == "__main__":
    main()
