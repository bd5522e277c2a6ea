"""Routing replay on one rank, on a tiny Qwen3-MoE whose routers are near-tied (every expert's router row is
one shared row plus 1e-6 x its own), so that the HF engine's and Megatron's top-k differ at rounding level.
Usage: _routing_replay_check.py OUT_DIR; prints one JSON line of measurements.

The HF engine samples with routing recorded; the actor scores the samples without replay and with R3, its
routers' chosen experts are read from Megatron's own routing map (a hook on each router), the shared-prefix,
whole-sequence and unpacked layouts are compared under replay, R2 records the actor's own routing, and one
actor update with recomputed activations is compared with one without.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model_providers.tiny_models import make_tiny_model
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

sys.path.insert(0, str(Path(__file__).parent))
from _batch import run_config  # noqa: E402

TIE = 1e-6


def near_tied_model(out: Path) -> Path:
    make_tiny_model("qwen3_moe", out, seed=3)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        shared = torch.randn(weights[name].shape[1], generator=gen)
        weights[name] = shared[None, :] + TIE * torch.randn(weights[name].shape, generator=gen)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def routing_maps(actor) -> list[list[torch.Tensor]]:
    """Hooks every router; the returned list gets, per router call, the [tokens, experts] map it routed by."""
    from megarlhf.learner.moe_metrics import stage_routers

    seen: list = []
    for _, router in stage_routers(actor.model):
        router.register_forward_hook(lambda module, args, output: seen.append(output[1].detach().clone()))
    return seen


def with_mode(actor, config, mode: str):
    """The actor with ``mode``'s replay installed (none: every router routes by itself)."""
    import dataclasses

    from megarlhf.learner.moe_metrics import stage_routers
    from megarlhf.learner.routing_replay import RoutingReplay

    config.algorithm.routing_replay = mode
    for _, router in stage_routers(actor.model):
        router.router_replay = None
    return dataclasses.replace(actor, routing_replay=RoutingReplay.attach(actor.model, actor.provider, mode,
                                                                          actor.runtime))


def chosen_equal_recorded(actor, batch, config, maps) -> tuple[bool, int]:
    """Whether every recorded token went to exactly its recorded experts in the last pass (and how many)."""
    from megarlhf.learner.routing_replay import UNROUTED
    from megarlhf.learner.step import micro_batches_for

    mbs = micro_batches_for(batch.input_ids, batch.lengths, batch.response_mask, config, actor.runtime,
                            routing=batch.routed_experts)
    layers = len(actor.routing_replay.stage_ordinals)
    ok, checked = len(maps) == layers * len(mbs), 0
    for k, mb in enumerate(mbs):
        for j, ordinal in enumerate(actor.routing_replay.stage_ordinals):
            record, used = mb.routing[:, ordinal].long(), maps[k * layers + j]
            recorded = record[:, 0] != UNROUTED
            expected = torch.zeros_like(used).scatter(1, record.clamp(min=0), True)
            ok = ok and torch.equal(used[recorded], expected[recorded])
            checked += int(recorded.sum())
    return ok, checked


def step0_gate_message(actor, batch, config) -> str | None:
    """The step-0 gate's error for a freely routed run, whose flips fail it (None: it passed)."""
    from megarlhf.loops.experience import Step0GateError, score
    from megarlhf.rollout.sync.gates import FLOORS

    try:
        score(batch, config, actor, None, None, gates=FLOORS["float32"])
    except Step0GateError as err:
        return str(err)
    return None


def main() -> None:
    out = Path(sys.argv[1])
    runtime = init_parallel(ParallelConfig())
    from megarlhf.rollout.engines.sampling import SamplingConfig
    from megarlhf.rollout.engines.hf import HFEngine
    from megarlhf.learner import ExperienceBatch, actor_update, build_actor, old_policy_logprobs
    from megarlhf.learner.routing_replay import UNROUTED, moe_layer_indices

    model = near_tied_model(out / "model")
    config = run_config(str(model), micro_batch_tokens=64)
    config.rollout.temperature = 1.0
    actor = build_actor(config, runtime)
    engine = HFEngine(str(model), dtype=torch.float32, device="cpu", seed=0, max_model_len=64,
                             routing_layers=moe_layer_indices(actor.provider))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 7, 3, 9)]
    rollout = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=1,
                                                      ignore_eos=True))
    records = rollout.routed_experts
    result = {"record_shapes_ok": all(tuple(r.shape) == (len(p) + len(s), 2, 2) for r, p, s in
                                      zip(records, rollout.prompt_ids, rollout.response_ids)),
              "last_token_unrouted": all(bool((r[-1] == UNROUTED).all()) for r in records),
              "others_routed": all(bool(((r[:-1] >= 0) & (r[:-1] < 8)).all()) for r in records),
              "prompt_records_shared": all(torch.equal(records[2 * i][:len(p)], records[2 * i + 1][:len(p)])
                                           for i, p in enumerate(prompts))}
    batch = ExperienceBatch.from_sequences(rollout.prompt_ids, rollout.response_ids, device=torch.device("cpu"),
                                           rollout_logprobs=rollout.logprobs, routed_experts=records)

    def gap(scored):
        diff = (scored.old_logprobs - batch.rollout_logprobs).abs()[batch.response_mask]
        return float(diff.max()), float(diff.mean())

    plain = with_mode(actor, config, "none")
    result["gap_none"] = gap(old_policy_logprobs(plain, batch, config)[0])
    result["step0_gate_none"] = step0_gate_message(plain, batch, config)
    replayed = with_mode(actor, config, "r3")
    maps = routing_maps(replayed)
    scored, metrics = old_policy_logprobs(replayed, batch, config)
    result["gap_r3"], result["metrics_r3"] = gap(scored), metrics
    result["chosen_equal_recorded"], result["tokens_checked"] = chosen_equal_recorded(replayed, batch, config, maps)
    maps.clear()
    from megarlhf.rollout.sync.calibration import natural_gap

    result["calibration_gap_r3"] = natural_gap(replayed, rollout, config)  # the gates' natural floor, replayed

    layouts = {}
    for name, train in (("whole", dict(share_prompt_prefix=False)), ("unpacked", dict(packing=False))):
        other = run_config(str(model), micro_batch_tokens=64, **train)
        other.rollout.temperature = 1.0
        other.algorithm.routing_replay = "r3"
        layouts[name] = float((old_policy_logprobs(replayed, batch, other)[0].old_logprobs -
                               scored.old_logprobs).abs().max())
    result["layout_gaps_r3"] = layouts

    r2 = with_mode(actor, config, "r2")
    recorded, metrics_r2 = old_policy_logprobs(r2, batch.replace(routed_experts=None), config)
    replay_own = with_mode(actor, config, "r3")  # replaying the R2 record gives the same old log-probs
    again, metrics_again = old_policy_logprobs(replay_own, recorded, config)
    result["r2"] = {"metrics": metrics_r2, "record_complete": bool((recorded.routed_experts[batch.response_mask]
                                                                    >= 0).all()),
                    "replay_equal": torch.equal(again.old_logprobs, recorded.old_logprobs),
                    "replay_metrics": metrics_again}

    trained = {}
    experience = scored.replace(advantages=torch.randn(scored.input_ids.shape, generator=gen),
                                ref_logprobs=scored.old_logprobs)
    for name, recompute in (("stored", "none"), ("recomputed", "full")):
        step_config = run_config(str(model), micro_batch_tokens=24)
        step_config.rollout.temperature = 1.0
        step_config.train.recompute.granularity = recompute
        fresh = with_mode(build_actor(step_config, runtime), step_config, "r3")
        metrics = actor_update(fresh, experience, step_config)
        trained[name] = (metrics, [p.detach().clone() for p in fresh.model.parameters()])
    result["update_metrics"] = {k: v for k, v in trained["stored"][0].items() if "routing" in k}
    result["recompute_param_gap"] = max(float((a - b).abs().max()) for a, b in
                                        zip(trained["stored"][1], trained["recomputed"][1]))
    result["update_moved"] = max(float((a - b).abs().max()) for a, b in
                                 zip(trained["stored"][1], [p for p in actor.model.parameters()]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
