"""Rank script for tests/rollout/test_bf16_gates.py: the dtype-aware gates on a bf16 trainer and bf16 engines.

Usage: _worker_bf16_gates.py MODEL_DIR OUT_DIR BACKEND [BACKEND ...] (one rank). For each rollout backend
(vllm, hf) the bf16 Megatron actor is synced into a bf16 engine and records:
* the probe's max / mean gap of a correct sync, and whether the gates passed it;
* the step-0 gap: the trainer's log-probs (training forward) of the engine's sampled responses vs the
  engine's own, max and mean over the response tokens;
* bitwise verification in bf16: a sync whose stream moves one element of one tensor by one bf16 ulp, and
  one that drops a layer's tensors after the actor's weights changed (the engine keeps that layer's
  previous weights), must both stop at the fingerprints; back at the weights of the last verified sync,
  the next sync must send them (the failed ones left the engine with others);
* a corrupted sync: one weight tensor perturbed by 100 bf16 ulps per element *inside the engine's loader*
  while the engine reports the fingerprints of the unperturbed tensors (what a kernel that reads correct
  weights wrongly would look like: only the probe can see it) must fail the probe gate; its gaps and the
  message are recorded.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from _faults import converter_fault
from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

TARGET = "model.layers.1.mlp.down_proj.weight"
ULPS = 100


def bf16_ulps(tensor: torch.Tensor, ulps: int, seed: int = 0) -> torch.Tensor:
    """``tensor`` moved by ``ulps`` bf16 units in the last place per element, in a random direction."""
    value = tensor.float()
    _, exponent = torch.frexp(value)  # |value| = m * 2**exponent, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(value), exponent - 8)  # bf16 keeps 8 significant bits
    sign = torch.randint(0, 2, value.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return (value + ulps * ulp * sign).to(tensor.dtype)


def config_for(model_dir: str, backend: str):
    from megarlhf.config.model import ModelConfig
    from megarlhf.config.schema import RunConfig
    from megarlhf.config.data import DataConfig
    from megarlhf.config.rollout import RolloutConfig

    return RunConfig(model=ModelConfig(path=model_dir, dtype="bfloat16"),
                     data=DataConfig(train_path="unused.jsonl", max_prompt_length=64),
                     rollout=RolloutConfig(backend=backend, max_new_tokens=24, kv_cache_mb=32, n_samples=4))


def random_prompts(vocab_size: int, seed: int, count: int = 16) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (int(n),), generator=gen).tolist()
            for n in torch.randint(4, 16, (count,), generator=gen)]


def step0_gap(engine, actor, config) -> tuple[float, float, int]:
    """(max, mean, tokens) of |trainer - engine| over the response tokens of a sampled rollout."""
    from megarlhf.rollout.engines.sampling import rollout_sampling
    from megarlhf.learner import ExperienceBatch, compute_logprobs

    rollout = engine.generate(random_prompts(actor.vocab_size, seed=5), dataclasses.replace(rollout_sampling(config.rollout, ()), seed=3))
    batch = ExperienceBatch.from_sequences(rollout.prompt_ids, rollout.response_ids, device=actor.runtime.device,
                                           rollout_logprobs=rollout.logprobs)
    gap = (compute_logprobs(actor, batch, config) - batch.rollout_logprobs).abs()[batch.response_mask]
    return float(gap.max()), float(gap.mean()), int(gap.numel())


def corrupted_probe(sync, engine) -> dict:
    """A sync whose engine holds TARGET perturbed by ULPS bf16 ulps while reporting the fingerprints of
    the unperturbed weights: the fingerprints agree, so only the probe can catch it."""
    from megarlhf.rollout.sync.weights import WeightSyncError

    real_load = engine.load_weights

    def mangling_load(weights):
        weights = list(weights)
        honest = real_load(iter(weights))
        real_load((name, bf16_ulps(tensor, ULPS) if name == TARGET else tensor) for name, tensor in weights)
        return honest

    engine.load_weights = mangling_load
    sync.held.forget()  # the actor is unchanged since the last (verified) sync: make this one send it again
    try:
        metrics = sync.sync()
        return {"message": None, "metrics": metrics}
    except WeightSyncError as err:
        return {"message": str(err)}
    finally:
        engine.load_weights = real_load


def bitwise_faults(sync, engine) -> dict:
    """Messages of a one-ulp sync and of a stale layer (module docstring); None where the sync passed."""
    from megarlhf.rollout.sync.weights import WeightSyncError

    real_load = engine.load_weights

    def one_ulp(stream):
        for name, tensor in stream:
            if name == TARGET:
                tensor = tensor.clone()
                bits = tensor.view(-1)[5:6].view(torch.int16)
                bits += 1
            yield name, tensor

    def drop_layer(stream):
        return ((n, t) for n, t in stream if not n.startswith("model.layers.1."))

    messages, params = {}, list(sync.actor.model.parameters())
    held = [p.detach().clone() for p in params]  # what the engine was last proven to hold
    for case, corrupt in (("one_ulp", one_ulp), ("stale_layer", drop_layer)):
        with torch.no_grad():  # an update's worth of change, so that the previous weights differ
            for param in params:
                param.mul_(1.01)
        engine.load_weights = lambda weights, corrupt=corrupt: real_load(corrupt(weights))
        try:
            sync.sync()
            messages[case] = None
        except WeightSyncError as err:
            messages[case] = str(err)
        finally:
            engine.load_weights = real_load
    with torch.no_grad():  # back to the weights of the last verified sync: the engine now holds others
        for param, value in zip(params, held):
            param.copy_(value)
    messages["restored"] = sync.sync()  # so this one must send them
    return messages


def run_backend(model_dir: str, backend: str, runtime) -> dict:
    from megarlhf.rollout.engines import EngineConfig, build_engine
    from megarlhf.rollout.sync.calibration import calibrate_colocated
    from megarlhf.rollout.sync.weights import WeightSync
    from megarlhf.learner import TrainModel
    from model_providers.hf_checkpoint import load_hf_model

    config = config_for(model_dir, backend)
    provider, model = load_hf_model(model_dir, torch.bfloat16, packed_sequences=True)
    actor = TrainModel("actor", model, provider, runtime)
    engine = build_engine(model_dir, EngineConfig.from_rollout(config.rollout, model_dtype="bfloat16", seed=0,
                                                              max_prompt_length=64), runtime.device)
    sync = WeightSync(engine, actor, config)
    result = {"converter_fault": converter_fault(sync, "layers.1.mlp.linear_fc2.weight")}  # before any sync
    # the engine holds the checkpoint it loaded; the natural floor samples prompts other than step0_gap's
    result["calibration"] = calibrate_colocated(sync, random_prompts(actor.vocab_size, seed=7), ())
    sync.held.forget()  # the engine holds the actor's weights already: make it take them (a real transfer)
    result["sync"] = sync.sync()  # raises if the gates refuse a correct bf16 sync
    result["step0_max"], result["step0_mean"], result["step0_tokens"] = step0_gap(engine, actor, config)
    result["bitwise"] = bitwise_faults(sync, engine)
    result["corrupted"] = corrupted_probe(sync, engine)
    result["after_corruption"] = sync.sync()  # a clean sync repairs the engine
    result["tolerances"] = vars(sync.tolerances)
    return result


def main() -> None:
    model_dir, out_dir, backends = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    runtime = init_parallel(ParallelConfig(), seed=1234)
    write_rank_result(out_dir, 0, {backend: run_backend(model_dir, backend, runtime) for backend in backends})


if __name__ == "__main__":
    main()
