"""Alignment in rounds on the policy's own samples: ``megarlhf rs`` (rejection sampling) and
``megarlhf online-dpo`` (online, iterative DPO).

Both run the RL driver's collection (:mod:`megarlhf.loops.collect`: draw this replica's share of
``train.global_batch_size`` prompts, wake the engine, sync the actor's weights verified bit for bit,
generate ``rollout.n_samples`` samples per prompt, score them with the configured rewards, rule-based or
a learned reward model), then, per round (a "step" of ``train.steps``):

* rs: keep samples by ``iterative.rs_keep`` (:func:`megarlhf.algorithms.selection.keep_best` /
  ``keep_above``) and take ``train.epochs_per_step`` SFT optimizer steps on them (loss on the response
  tokens, :func:`megarlhf.learner.sft_step`). The kept samples are appended to
  ``<run_dir>/rs_kept.jsonl`` as SFT rows, with ``step``, ``reward``, ``ground_truth`` and
  ``finish_reason``.
* online-dpo: form (chosen, rejected) pairs by ``iterative.pair_rule`` and ``min_margin``
  (:func:`~megarlhf.algorithms.selection.preference_pairs`; ties form none) and take
  ``train.epochs_per_step`` steps of ``preference.loss`` (a paired loss of the DPO family) on them. The
  reference is model.path (``iterative.reference=fixed``) or the policy as the round began (``refresh``).
  Pairs are appended to ``<run_dir>/online_pairs.jsonl`` as ``megarlhf dpo`` rows (prompt, chosen,
  rejected, with their rewards).

A sample the token limit cut off is never kept or chosen unless ``iterative.keep_truncated`` (it may be a
pair's rejected side). The rows are what ``megarlhf sft`` / ``megarlhf dpo`` read back to the same tokens
as far as decoding and re-tokenising the text allows: in chat mode the conversation as a message list
(``messages`` for SFT: set ``data.messages_key=messages``; a message-list ``prompt`` for DPO), in plain
mode the prompt text and the response; either way the prompt already holds the system prompt, so leave
``data.system_prompt`` unset when reading them. Multi-turn rollouts (``rollout.env``) are refused: their
tool observations would not survive as such rows.

Kept samples or pairs are gathered over the data-parallel replicas in replica order and dealt out
round-robin, so every replica trains on a share; a round with fewer than one per replica trains on
nothing (``*/skipped_updates`` counts it) but advances the learning-rate schedule as a trained round would,
so the schedule ends where ``train.steps`` puts its end. A sample whose reward failed (``reward/failures``:
a reward model's NaN, a verifier that timed out) is neither kept nor paired. ``iterative.rs_threshold``
"auto" is 0.5 for rule rewards and none (each prompt's best) under a learned reward. Evaluation,
checkpoints (every ``checkpoint.every`` rounds), resume and metrics work as in RL; metrics per round:
``rs/kept``, ``rs/kept_fraction`` (of the samples), ``rs/prompts_kept_fraction``, ``rs/reward_kept`` (mean
reward of the kept samples) and ``reward/mean`` (of all); ``odpo/pairs``, ``odpo/prompts_paired_fraction``,
``odpo/reward_gap``; the SFT or DPO step's metrics of the round's last optimizer step.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from megarlhf.algorithms.preference_losses import PREFERENCE_LOSSES
from megarlhf.algorithms.selection import keep_above, keep_best, preference_pairs
from megarlhf.config.schema import RunConfig
from megarlhf.core.errors import ConfigError
from megarlhf.data.preference import PreferencePair
from megarlhf.data.sft import SFTExample
from megarlhf.learner import build_actor, build_reference, sft_step
from megarlhf.learner.preference import pair_batch, preference_step, sequence_logprobs
from megarlhf.loops.collect import Collected, collect
from megarlhf.loops.policy_loop import open_policy_loop, scheduled_eval
from megarlhf.records.metrics import truncate_records_after
from megarlhf.rollout.phase import serve_engine_rank
from megarlhf.run.context import RunContext, start_run

KEPT_FILE = {"rs": "rs_kept.jsonl", "online-dpo": "online_pairs.jsonl"}
CONSOLE_KEYS = {"rs": ("rs/kept_fraction", "rs/reward_kept", "sft/loss", "eval/accuracy", "time/step_s"),
                "online-dpo": ("odpo/pairs", "dpo/loss", "rewards/accuracy", "eval/accuracy", "time/step_s")}


def check_iterative_config(config: RunConfig, mode: str) -> None:
    """Refuses settings the mode cannot run, naming the key."""
    if config.algorithm.dynamic_sampling.enabled:
        raise ConfigError(f"megarlhf {mode}: algorithm.dynamic_sampling is RL's (DAPO); turn it off")
    if config.rollout.max_staleness:
        raise ConfigError(f"megarlhf {mode}: rollout.max_staleness must be 0 (each round samples the current "
                          f"policy), got {config.rollout.max_staleness}")
    if config.rollout.env is not None:
        raise ConfigError(f"megarlhf {mode}: rollout.env (multi-turn tool episodes) is not supported: the kept rows "
                          f"would lose the tool observations between the model's turns")
    if mode == "rs":
        config.iterative.keep_threshold(config.reward.reward_model_path is not None)  # refuses what cannot resolve
    if mode == "online-dpo":
        if not PREFERENCE_LOSSES.get(config.preference.loss).paired:
            raise ConfigError(f"megarlhf online-dpo: preference.loss={config.preference.loss!r} reads unpaired "
                              f"rows; online DPO forms pairs (dpo, ipo, simpo)")
        if config.rollout.n_samples < 2:
            raise ConfigError(f"megarlhf online-dpo: rollout.n_samples must be >= 2 to form pairs, got "
                              f"{config.rollout.n_samples}")


def _allowed(got: Collected, config: RunConfig) -> list[bool]:
    """Which samples may be kept or chosen: those the token limit did not cut off (unless keep_truncated), never
    an episode that ended in an error (its conversation broke the chat template), and only those scored."""
    cut_ok = config.iterative.keep_truncated
    scored = set(_scored(got))
    return [k in scored and reason != "error" and (cut_ok or reason != "length")
            for k, reason in enumerate(got.rollout.finish_reasons)]


def _scored(got: Collected) -> list[int]:
    """The samples whose reward did not fail: a failed one (a NaN from a reward model, a verifier that timed
    out) is counted in ``reward/failures`` and takes no part in the round, neither kept nor in a pair."""
    return [k for k in range(len(got.rewards)) if not (got.failed and got.failed[k])]


def _sample_record(got: Collected, k: int, tokenizer) -> dict:
    """Sample ``k`` as an SFT row: the conversation (chat mode) or the prompt and response text."""
    example = got.examples[got.rollout.prompt_index[k]]
    text = tokenizer.decode(got.rollout.response_ids[k], skip_special_tokens=True)
    if example.messages is not None:
        return {"messages": [*example.messages, {"role": "assistant", "content": text}]}
    return {"prompt": example.prompt, "response": text}


def _rs_round(got: Collected, config: RunConfig, tokenizer, step: int):
    """(this replica's kept samples as SFT examples, their log records, metric sums) of an RS round."""
    settings, rollout = config.iterative, got.rollout
    allowed = _allowed(got, config)
    threshold = settings.keep_threshold(config.reward.reward_model_path is not None)
    if settings.rs_keep == "best":
        kept = keep_best(got.rewards, rollout.prompt_index, threshold, allowed)
    else:
        kept = keep_above(got.rewards, threshold, allowed)
    items, records = [], []
    for k in kept:
        prompt, response = rollout.prompt_ids[k], rollout.response_ids[k]
        items.append(SFTExample(list(prompt) + list(response), [0] * len(prompt) + [1] * len(response)))
        records.append({"step": step, **_sample_record(got, k, tokenizer), "reward": got.rewards[k],
                        "ground_truth": got.examples[rollout.prompt_index[k]].ground_truth,
                        "finish_reason": rollout.finish_reasons[k]})
    prompts_kept = len({rollout.prompt_index[k] for k in kept})
    sums = [len(kept), len(got.rewards), len(got.examples), prompts_kept, sum(got.rewards[k] for k in kept)]
    return items, records, sums


def _odpo_round(got: Collected, config: RunConfig, tokenizer, step: int):
    """(this replica's pairs, their log records, metric sums) of an online-DPO round."""
    settings, rollout = config.iterative, got.rollout
    use, allowed = _scored(got), _allowed(got, config)
    pairs = preference_pairs([got.rewards[k] for k in use], [rollout.prompt_index[k] for k in use],
                             [rollout.response_ids[k] for k in use], settings.pair_rule, settings.min_margin,
                             [allowed[k] for k in use])
    pairs = [(use[w], use[l]) for w, l in pairs]
    items, records = [], []
    for w, l in pairs:
        prompt, chosen, rejected = (list(x) for x in (rollout.prompt_ids[w], rollout.response_ids[w],
                                                       rollout.response_ids[l]))
        items.append(PreferencePair(len(items), len(prompt), prompt + chosen, [0] * len(prompt) + [1] * len(chosen),
                                    prompt + rejected, [0] * len(prompt) + [1] * len(rejected)))
        chosen, rejected = _sample_record(got, w, tokenizer), _sample_record(got, l, tokenizer)
        if "messages" in chosen:
            row = {"prompt": chosen["messages"][:-1], "chosen": chosen["messages"][-1:],
                   "rejected": rejected["messages"][-1:]}
        else:
            row = {"prompt": chosen["prompt"], "chosen": chosen["response"], "rejected": rejected["response"]}
        records.append({"step": step, **row, "chosen_reward": got.rewards[w], "rejected_reward": got.rewards[l]})
    paired_prompts = len({rollout.prompt_index[w] for w, _ in pairs})
    sums = [len(pairs), len(got.rewards), len(got.examples), paired_prompts,
            sum(got.rewards[w] - got.rewards[l] for w, l in pairs)]
    return items, records, sums


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _round_metrics(mode: str, sums: list[float]) -> dict[str, float]:
    if mode == "rs":
        kept, samples, prompts, prompts_kept, reward_kept = sums
        return {"rs/kept": kept, "rs/kept_fraction": _ratio(kept, samples),
                "rs/prompts_kept_fraction": _ratio(prompts_kept, prompts), "rs/reward_kept": _ratio(reward_kept, kept)}
    pairs, _, prompts, paired, gap = sums
    return {"odpo/pairs": pairs, "odpo/prompts_paired_fraction": _ratio(paired, prompts),
            "odpo/reward_gap": _ratio(gap, pairs)}


class KeptLog:
    """Appends a round's kept samples or pairs to ``<run_dir>/<KEPT_FILE>`` from global rank 0; a resumed
    run first cuts the file back to the rounds its checkpoint completed."""

    def __init__(self, run, mode: str, first_step: int):
        self.active = run.is_main
        self.path = run.run_dir / KEPT_FILE[mode]
        if self.active and self.path.exists():
            truncate_records_after(self.path, first_step - 1)

    def write(self, records: list[dict]) -> None:
        if self.active:
            with self.path.open("a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))


def _train_round(run: RunContext, mode: str, items: list) -> dict[str, float]:
    """``train.epochs_per_step`` optimizer steps on this replica's share ``items``; the last one's metrics."""
    config, actor, metrics = run.config, run.actor, {}
    on_nonfinite = config.train.on_nonfinite
    if mode == "rs":
        for _ in range(config.train.epochs_per_step):
            metrics = sft_step(actor, items, config, on_nonfinite=on_nonfinite, pad_id=run.pad_id)
        return metrics
    batch = pair_batch(items, actor.runtime.device, run.pad_id)
    ref = None
    if PREFERENCE_LOSSES.get(config.preference.loss).needs_reference:
        # the round's start policy (iterative.reference=refresh) or model.path (fixed)
        ref = sequence_logprobs(actor if run.reference is None else run.reference, batch, config)
    for _ in range(config.train.epochs_per_step):
        metrics = preference_step(actor, batch, config, ref, on_nonfinite=on_nonfinite)
    return metrics


def train_iterative(config: RunConfig, mode: str) -> Path | None:
    """Runs ``config.train.steps`` rounds of ``mode`` ("rs" or "online-dpo"; resuming if asked); returns the
    exported HF directory (None on the engine ranks of the disaggregated placement)."""
    check_iterative_config(config, mode)
    run = start_run(config, mode)
    if run.is_engine_rank:
        serve_engine_rank(config, run.runtime)
        return None
    prompts, eval_prompts = run.train_and_eval_prompts()
    steps = config.train.steps
    run.actor = build_actor(config, run.runtime, total_steps=steps * config.train.epochs_per_step)
    if (mode == "online-dpo" and PREFERENCE_LOSSES.get(config.preference.loss).needs_reference
            and config.iterative.reference == "fixed"):
        run.reference = build_reference(config, run.runtime, run.actor)
    sampler, first_step = open_policy_loop(run, prompts, console_keys=CONSOLE_KEYS[mode])
    kept_log = KeptLog(run, mode, first_step)
    for step in range(first_step, steps):
        run.checkpointer.poll()  # publishes a background save (checkpoint.async_save) whose write has finished
        start = time.perf_counter()
        metrics = scheduled_eval(run, eval_prompts, step)
        metrics.update(_round(run, mode, collect(run, sampler, prompts, step), step, kept_log))
        run.actor.policy_version = step + 1
        metrics["time/step_s"] = time.perf_counter() - start
        run.log_step(step, metrics)
        run.save(step + 1, lambda: {"sampler": sampler.state_dict()})
    run.checkpointer.close()
    if config.eval.every:  # also after resuming a finished run: the recorder cut the final record, it is redone
        run.log_step(steps, scheduled_eval(run, eval_prompts, steps, last=True))
    return run.finish_policy_run(CONSOLE_KEYS[mode][:4])


def _round(run: RunContext, mode: str, got: Collected, step: int, kept_log: KeptLog) -> dict[str, float]:
    """One round after its collection: keep (rs) or pair (online-dpo) samples, gather them over the
    replicas, log them, train on this replica's share; the round's metrics."""
    runtime = run.runtime
    items, records, sums = (_rs_round if mode == "rs" else _odpo_round)(got, run.config, run.tokenizer, step)
    shares = runtime.all_gather_objects((items, records), over="dp")  # replica order: layout-independent
    everything = [item for share in shares for item in share[0]]
    kept_log.write([record for share in shares for record in share[1]])
    metrics = {**got.metrics, **_round_metrics(mode, runtime.all_reduce(sums))}
    train_start = time.perf_counter()
    skipped = len(everything) < runtime.dp.size
    if not skipped:
        metrics.update(_train_round(run, mode, everything[runtime.dp.rank::runtime.dp.size]))
    else:  # the schedule runs over the rounds (train.steps x epochs_per_step), trained or not
        run.actor.scheduler.step(increment=run.config.train.epochs_per_step)
    metrics.update({f"{'rs' if mode == 'rs' else 'odpo'}/skipped_updates": float(skipped),
                    "time/train_s": time.perf_counter() - train_start})
    return metrics
