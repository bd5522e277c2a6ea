"""Rank script for the rollout tests. Usage: _worker_rollout.py TRAINER_TP ENGINE_TP MODEL_DIR OUT_DIR

On every rank: loads the tiny HF model into Megatron (trainer TP as given, DP = world / TP), builds the
vLLM engine (ENGINE_TP=1: one per rank, each generating its share of the prompts; ENGINE_TP=world: one
shared engine), and records
* the sync metrics and probe difference;
* greedy generations of the engine vs the trainer's own greedy decoding (full-logit argmax, one batched
  forward per step) on 64 prompts;
* sampled-token log-probs of the engine vs the trainer's teacher-forced log-probs, before training and
  after 3 AdamW steps + a re-sync;
* seeded sampling: the same seed twice (and, with per-rank engines, on two independent engines);
* the colocate scheduler's offload/onload round trip (bit-exact state, same loss as without it);
* the messages of deliberately corrupted syncs (a perturbed tensor, a skipped tensor, a dropped layer,
  a tied head left unprocessed).
"""
from __future__ import annotations

import logging
import sys

import torch
import torch.distributed as dist

from _faults import converter_fault
from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

NUM_PROMPTS, NEW_TOKENS = 64, 16


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(3, 12, (NUM_PROMPTS,), generator=gen)
    return [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def full_logits(model, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab]


def trainer_logprobs(actor, config, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
    """The trainer's teacher-forced log-probs of tokens 1.. of each sequence: the training forward
    (packed micro-batches, fused log-prob op), as scoring and the sync probe use it."""
    from megarlhf.learner import ExperienceBatch, compute_logprobs

    batch = ExperienceBatch.from_sequences([s[:1] for s in sequences], [s[1:] for s in sequences],
                                           device=torch.device("cpu"))
    out = compute_logprobs(actor, batch, config, temperature=temperature)
    return [out[i, 1:len(s)].tolist() for i, s in enumerate(sequences)]


@torch.no_grad()
def trainer_greedy(model, prompt_list: list[list[int]], vocab: int) -> list[list[int]]:
    """Greedy decoding with the Megatron model: right-padded batch, argmax at each sequence's last token."""
    model.eval()
    seqs = [list(p) for p in prompt_list]
    for _ in range(NEW_TOKENS):
        longest = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
        logits = full_logits(model, ids, vocab)
        for i, s in enumerate(seqs):
            s.append(int(logits[i, len(s) - 1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompt_list)]


def rollout_vs_trainer(engine, actor, config, prompt_list, engine_tp: int, seed: int) -> dict:
    """Engine greedy + sampled rollouts for this rank's share vs the trainer (all ranks, all prompts)."""
    from megarlhf.rollout.engines.sampling import SamplingConfig

    model, provider = actor.model, actor.provider
    rank, world = dist.get_rank(), dist.get_world_size()
    share = list(range(NUM_PROMPTS)) if engine_tp > 1 else list(range(rank, NUM_PROMPTS, world))
    mine = [prompt_list[i] for i in share]
    greedy = engine.generate(mine, SamplingConfig(n=1, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    sampled = engine.generate(mine, SamplingConfig(n=2, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=seed))
    engine_greedy = {share[i]: r for i, r in zip(greedy.prompt_index, greedy.response_ids)}
    all_greedy = {k: v for part in gather_objects(engine_greedy) for k, v in part.items()}
    vocab = provider.hf_config.vocab_size
    reference = trainer_greedy(model, prompt_list, vocab)
    samples = [(p + r, lp) for p, r, lp in zip(sampled.prompt_ids, sampled.response_ids, sampled.logprobs)]
    all_samples = [s for part in gather_objects(samples) for s in part]
    trainer_lp = trainer_logprobs(actor, config, [seq for seq, _ in all_samples])
    diffs = [abs(t - e) for (seq, lp), tl in zip(all_samples, trainer_lp) for t, e in zip(tl[-len(lp):], lp)]
    return {"greedy_equal": sum(all_greedy[i] == reference[i] for i in range(NUM_PROMPTS)),
            "greedy_prompts": len(all_greedy), "sampled_tokens": len(diffs), "logprob_max_diff": max(diffs),
            "finish_reasons": sorted(set(sampled.finish_reasons)),
            "greedy_finish": sorted(set(greedy.finish_reasons))}


def train_with(model, provider, opt, steps: int) -> list[float]:
    """A few optimizer steps on a fixed batch (next-token loss); grads averaged over data-parallel ranks."""
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, provider.hf_config.vocab_size, (4, 24), generator=gen)
    losses = []
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids[:, :-1], position_ids=torch.arange(23).expand(4, -1), attention_mask=None,
                     labels=ids[:, 1:]).mean()
        loss.backward()
        if ps.get_data_parallel_world_size() > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
                p.grad /= ps.get_data_parallel_world_size()
        opt.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def logprobs_vs_naive(actor, config) -> dict:
    """The training forward's log-probs vs log_softmax of the full (gathered, unpadded) logits, at
    temperature 1 and 0.7, packed into several micro-batches (a small token budget)."""
    import copy

    vocab = actor.provider.hf_config.vocab_size
    ids = torch.randint(0, vocab, (4, 20), generator=torch.Generator().manual_seed(9))
    logits = full_logits(actor.model.eval(), ids, vocab)[:, :-1]
    small = copy.deepcopy(config)
    small.train.micro_batch_tokens = 40  # two sequences per micro-batch
    out = {}
    for temp in (1.0, 0.7):
        ref = torch.log_softmax(logits.double() / temp, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        got = torch.tensor(trainer_logprobs(actor, small, ids.tolist(), temperature=temp), dtype=torch.float64)
        out[f"t{temp}"] = (got - ref).abs().max().item()
    out["shape"] = list(got.shape)
    return out


def seeded_repeat(engine, prompt_list) -> dict:
    from megarlhf.rollout.engines.sampling import SamplingConfig

    cfg = SamplingConfig(n=3, temperature=0.9, max_new_tokens=12, seed=77)
    a, b = engine.generate(prompt_list[:8], cfg), engine.generate(prompt_list[:8], cfg)
    other = engine.generate(prompt_list[:8], SamplingConfig(n=3, temperature=1.0, max_new_tokens=12, seed=78))
    return {"same_seed_equal": a.response_ids == b.response_ids and a.logprobs == b.logprobs,
            "other_seed_differs": a.response_ids != other.response_ids,
            "samples_differ_within_prompt": a.response_ids[0] != a.response_ids[1],
            "responses": a.response_ids}


def corrupted_syncs(sync) -> dict:
    """Messages of syncs that leave the engine with other weights than the trainer's: one tensor
    perturbed by one ulp, one tensor skipped, a whole bucket dropped (the engine keeps the previous
    weights of those layers), and the tied LM head not re-processed after the reload (vLLM skips it;
    its kernels would keep the previous embedding)."""
    from contextlib import nullcontext
    from unittest import mock

    from megarlhf.rollout.sync.weights import WeightSyncError

    engine, real_load = sync.engine, sync.engine.load_weights
    target = "model.layers.1.mlp.down_proj.weight"

    def perturb(stream):
        for name, t in stream:
            if name == target:
                t = t.clone()
                t.view(-1)[7] = torch.nextafter(t.view(-1)[7], torch.tensor(float("inf")))
            yield name, t

    def skip(stream):
        return ((n, t) for n, t in stream if n != "model.layers.0.self_attn.k_proj.weight")

    def drop_bucket(stream):  # every tensor of layer 1: the engine keeps that layer's previous weights
        return ((n, t) for n, t in stream if not n.startswith("model.layers.1."))

    def run(corrupt=None, patch=None) -> str | None:
        if corrupt is not None:
            engine.load_weights = lambda weights: real_load(corrupt(weights))
        try:
            with patch or nullcontext():
                sync.sync()
            return None
        except WeightSyncError as err:
            return str(err)
        finally:
            engine.load_weights = real_load

    messages = {"perturbed": run(perturb), "skipped": run(skip)}
    with torch.no_grad():  # an update's worth of change, so that the previous weights differ
        for param in sync.actor.model.parameters():
            param.mul_(1.01)
    messages["stale_layer"] = run(drop_bucket)
    messages["tied_head_unprocessed"] = run(patch=mock.patch("megarlhf.rollout.engines.vllm_worker.reprocess_tied"))
    messages["clean_after"] = run()  # a clean sync repairs the engine
    return messages


def snapshot(model, opt) -> dict:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "opt": {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(opt.state.values())}}


def same_state(a: dict, b: dict) -> bool:
    def eq(x, y):
        return (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                              and x.shape == y.shape and torch.equal(x, y))
    return (all(eq(x, y) for x, y in zip(a["params"], b["params"])) and len(a["params"]) == len(b["params"])
            and all(eq(x, y) for x, y in zip(a["grads"], b["grads"])) and a["opt"].keys() == b["opt"].keys()
            and all(a["opt"][i].keys() == b["opt"][i].keys() and all(eq(a["opt"][i][k], b["opt"][i][k])
                                                                      for k in a["opt"][i]) for i in a["opt"]))


def restore(model, opt, snap: dict) -> None:
    with torch.no_grad():
        for p, v, g in zip(model.parameters(), snap["params"], snap["grads"]):
            p.data = v.clone()
            p.grad = None if g is None else g.clone()
    for st, saved in zip(opt.state.values(), snap["opt"].values()):
        st.update({k: v.clone() for k, v in saved.items()})


def colocate_round_trip(engine, sync, model, provider, model_dir: str, prompt_list) -> dict:
    """Offload -> rollout -> onload: bit-identical state; the next steps match a run without the trip."""
    from megarlhf.rollout.colocate import ColocateScheduler, ColocateStateError, OffloadedModel
    from megarlhf.rollout.engines.sampling import SamplingConfig
    from model_providers.hf_checkpoint import load_hf_model

    _, reference = load_hf_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_with(model, provider, opt, steps=1)  # creates grads and optimizer state
    before, ref_before = snapshot(model, opt), [p.detach().clone() for p in reference.parameters()]
    sched = ColocateScheduler(engine, sync, OffloadedModel("actor", model, [opt], skip_host_storages=False),
                              [OffloadedModel("reference", reference, skip_host_storages=False)])
    result = {"enter": sched.enter_rollout(), "state_in_rollout": sched.state.value}
    # Offload frees storages in place (tensors keep their shapes so that views stay valid).
    result["actor_params_freed"] = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    result["grads_freed"] = all(p.grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    result["reference_freed"] = all(p.untyped_storage().nbytes() == 0 for p in reference.parameters())
    result["rollout_tokens"] = engine.generate(prompt_list[:4], SamplingConfig(n=1, temperature=1.0, max_new_tokens=8,
                                                                               seed=1)).num_tokens
    try:
        sched.enter_rollout()
        result["illegal_enter"] = None
    except ColocateStateError as err:
        result["illegal_enter"] = str(err)
    result["exit"] = sched.exit_rollout()
    try:
        sched.exit_rollout()
        result["illegal_exit"] = None
    except ColocateStateError as err:
        result["illegal_exit"] = str(err)
    result["state_after"] = sched.state.value
    result["round_trip_equal"] = same_state(before, snapshot(model, opt))
    result["reference_equal"] = all(torch.equal(a, b) for a, b in zip(ref_before, reference.parameters()))
    result["losses_after_trip"] = train_with(model, provider, opt, steps=2)
    restore(model, opt, before)
    result["losses_without_trip"] = train_with(model, provider, opt, steps=2)
    return result


def run_config(model_dir: str, engine_tp: int):
    from megarlhf.config.model import ModelConfig
    from megarlhf.config.schema import RunConfig
    from megarlhf.config.data import DataConfig
    from megarlhf.config.rollout import RolloutConfig, WeightSyncConfig

    return RunConfig(model=ModelConfig(path=model_dir, dtype="float32"),
                     data=DataConfig(train_path="unused.jsonl", max_prompt_length=192),
                     rollout=RolloutConfig(tensor_parallel_size=engine_tp, max_new_tokens=64, kv_cache_mb=64,
                                           weight_sync=WeightSyncConfig(bucket_mb=0.25)))


class ReloadWarnings(logging.Handler):
    """Collects the warnings of vLLM's in-place reload logger (engines.weights.RELOAD_LOGGER) while entered."""

    LOGGER = "vllm.model_executor.model_loader.reload.layerwise"

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeHandler(self)


def main() -> None:
    trainer_tp, engine_tp, model_dir, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    runtime = init_parallel(ParallelConfig(tensor_model_parallel_size=trainer_tp), seed=1234)
    from megarlhf.rollout.engines import EngineConfig
    from megarlhf.rollout.engines.vllm import VLLMEngine
    from megarlhf.rollout.sync.calibration import calibrate_colocated
    from megarlhf.rollout.sync.weights import WeightSync
    from megarlhf.learner import TrainModel
    from model_providers.hf_checkpoint import load_hf_model

    config = run_config(model_dir, engine_tp)
    provider, model = load_hf_model(model_dir, packed_sequences=True)
    actor = TrainModel("actor", model, provider, runtime)
    engine = VLLMEngine(model_dir, EngineConfig.from_rollout(config.rollout, model_dtype="float32", seed=0,
                                                                max_prompt_length=192))
    sync = WeightSync(engine, actor, config)
    prompt_list = prompts(provider.hf_config.vocab_size)
    converter = converter_fault(sync, "embedding.word_embeddings.weight")  # before the engine holds other weights
    calibration = calibrate_colocated(sync, prompt_list[:2], ())
    with ReloadWarnings() as reload_warnings:  # what vLLM's in-place reload warns about in correct syncs
        result = {"converter_fault": converter, "calibration": calibration, "sync0": sync.sync(),
                  "naive_logprobs": logprobs_vs_naive(actor, config)}
        result["before"] = rollout_vs_trainer(engine, actor, config, prompt_list, engine_tp, seed=3)
        result["losses"] = train_with(model, provider, torch.optim.AdamW(model.parameters(), lr=3e-3), steps=3)
        result["sync1"] = sync.sync()
    result["reload_warnings"] = reload_warnings.messages
    result["after"] = rollout_vs_trainer(engine, actor, config, prompt_list, engine_tp, seed=4)
    result["seeded"] = seeded_repeat(engine, prompt_list)
    result["colocate"] = colocate_round_trip(engine, sync, model, provider, model_dir, prompt_list)
    result["corrupted"] = corrupted_syncs(sync)
    write_rank_result(out_dir, dist.get_rank(), result)


if __name__ == "__main__":
    main()
