"""One SFT step and one actor update of a tiny mixture-of-experts model in one (TP, EP) layout, with the
gradients each produced, then an SFT step with the router's load-balancing and z-losses on (at TP > 1,
where the MoE layers run sequence-parallel, their refusal), then an update replaying a routing record.
Usage: _worker_moe.py TP EP MODEL_DIR OUT_DIR

The batch is :mod:`_batch`'s, split over the data-parallel ranks (every other sequence), so the global
batch is the same in every layout. The plain (not distributed) optimizer is used, so that every rank's
gradient buffers hold the whole reduced gradients. The gradients are read where Megatron's optimizer would read them
(after DDP's reduction, before the step) and written in HF naming (``iter_hf_weights`` over the gradient
buffers: experts gathered over the expert-parallel group) to ``OUT_DIR/grads-<step>.pt`` by rank 0; every
rank records the step's metrics in ``rank<r>.json``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

sys.path.insert(0, str(Path(__file__).parent))
from _batch import experience, noise, run_config  # noqa: E402


def capture_gradients(actor, out: Path, name: str) -> None:
    """Wraps the optimizer's step: first write the reduced gradients in HF naming (collective)."""
    from model_providers.hf_checkpoint import iter_hf_weights, unwrap

    step = actor.optimizer.step

    def step_after_capture():
        params = list(unwrap(actor.model).parameters())
        data = [p.data for p in params]
        for p in params:
            p.data = p.main_grad.to(p.dtype)
        grads = dict(iter_hf_weights(actor.model, actor.provider))
        for p, d in zip(params, data):
            p.data = d
        if dist.get_rank() == 0:
            torch.save(grads, out / f"grads-{name}.pt")
        return step()

    actor.optimizer.step = step_after_capture


def main() -> None:
    tp, ep = int(sys.argv[1]), int(sys.argv[2])
    model_dir, out = sys.argv[3], Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    runtime = init_parallel(ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep))
    from megarlhf.data.sft import SFTExample
    from megarlhf.learner import actor_update, build_actor, old_policy_logprobs, sft_step
    from megarlhf.learner.step import micro_batches_for

    cfg = run_config(model_dir)
    cfg.optim.use_distributed_optimizer = False  # every rank's gradient buffers hold the reduced gradients
    batch = experience()
    rows = torch.arange(batch.batch_size)[runtime.dp.rank::runtime.dp.size]
    local = batch.select(rows)
    lengths = local.lengths.tolist()
    examples = [SFTExample(local.input_ids[i, :n].tolist(), local.response_mask[i, :n].int().tolist())
                for i, n in enumerate(lengths)]
    actor = build_actor(cfg, runtime)
    capture_gradients(actor, out, "sft")
    sft = sft_step(actor, examples, cfg)

    actor = build_actor(cfg, runtime)
    capture_gradients(actor, out, "actor")
    lp0 = torch.zeros(batch.input_ids.shape)
    full = batch.replace(old_logprobs=lp0 + noise(lp0.shape, 1, 0.15) - 5.0, ref_logprobs=lp0 + noise(lp0.shape, 2, 0.3) - 5.0)
    update = actor_update(actor, full.select(rows), cfg)

    # the same global batch split 6 + 2: the ranks' micro-batch counts differ, and under expert parallelism the
    # rank with fewer runs padding micro-batches (megarlhf.learner.forward.expert_parallel_padding)
    uneven = torch.arange(6) if runtime.dp.rank == 0 else torch.arange(6, 8)
    mine = full.select(uneven)
    counts = runtime.all_gather_objects(len(micro_batches_for(mine.input_ids, mine.lengths, mine.response_mask, cfg,
                                                              runtime)), over="dp")
    actor = build_actor(cfg, runtime)
    capture_gradients(actor, out, "actor-uneven")
    uneven_update = {f"uneven/{k}": v for k, v in actor_update(actor, mine, cfg).items()}

    cfg.model.moe.aux_loss_coeff, cfg.model.moe.z_loss_coeff = 0.01, 0.001
    with_aux = {}
    if tp > 1:  # sequence parallelism: router losses are refused by name
        try:
            build_actor(cfg, runtime)
        except Exception as err:  # noqa: BLE001 - the message is the result
            with_aux["aux_refused"] = str(err)
    else:
        actor = build_actor(cfg, runtime)
        capture_gradients(actor, out, "sft-aux")
        with_aux.update({f"aux/{k}": v for k, v in sft_step(actor, examples, cfg).items()})
        # the uneven split with the router losses on: padding micro-batches (EP2) must add nothing, not NaN
        actor = build_actor(cfg, runtime)
        capture_gradients(actor, out, "actor-uneven-aux")
        with_aux.update({f"aux-uneven/{k}": v for k, v in actor_update(actor, mine, cfg).items()})
    # routing replay (R3) of a random routing record on the uneven split: every token goes to the recorded
    # experts in every layout, padding micro-batches included (router losses off: with them the uneven split's
    # layouts differ by design, see test_router_losses_with_padding_micro_batches)
    cfg.model.moe.aux_loss_coeff, cfg.model.moe.z_loss_coeff = 0.0, 0.0
    cfg.algorithm.routing_replay = "r3"
    actor = build_actor(cfg, runtime)
    capture_gradients(actor, out, "actor-replay")
    record = random_routing(full, actor.provider)
    replayed = {f"replay/{k}": v for k, v in actor_update(actor, full.replace(routed_experts=record).select(uneven),
                                                           cfg).items()}
    # R2 records the actor's own routing in the old-log-prob pass, on the uneven split (padding micro-batches at
    # EP2 must record nothing)
    cfg.algorithm.routing_replay = "r2"
    cfg.train.micro_batch_tokens = 12  # a micro-batch per sequence: the ranks' counts and sizes differ
    actor = build_actor(cfg, runtime)
    recorded, _ = old_policy_logprobs(actor, mine, cfg)
    replayed["r2_record_complete"] = bool((recorded.routed_experts[recorded.response_mask] >= 0).all())
    torch.save(recorded.routed_experts, out / f"r2-record-rank{dist.get_rank()}.pt")
    write_rank_result(out, dist.get_rank(), {"dp": runtime.dp.size, "ep": runtime.ep.size, "edp": runtime.edp.size,
                                             "uneven_micro_batches": counts, **sft, **update, **uneven_update,
                                             **with_aux, **replayed})


def random_routing(batch, provider) -> torch.Tensor:
    """A routing record [B, L, moe_layers, top_k]: distinct random experts for every token (seeded)."""
    from megarlhf.learner.routing_replay import ROUTING_DTYPE, moe_layer_indices

    gen = torch.Generator().manual_seed(7)
    scores = torch.rand((*batch.input_ids.shape, len(moe_layer_indices(provider)), provider.num_experts), generator=gen)
    return scores.argsort(-1)[..., :provider.top_k].to(ROUTING_DTYPE)


if __name__ == "__main__":
    main()
