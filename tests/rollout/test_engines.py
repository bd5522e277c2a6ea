"""The rollout-engine contract and its registry: every backend is built by name, the fake backend is
deterministic yet scores with the weights it holds, and abort keeps what was generated."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from megarlhf.rollout.engines import ENGINES, EngineConfig, RolloutEngine, SamplingConfig, WeightBucket, build_engine
from megarlhf.rollout.engines.fake import FakeEngine
from megarlhf.rollout.engines.hf import HFEngine

MAX_LEN = 96
PROMPTS = [[5, 9, 11, 2], [7, 3], [40, 41, 42, 43, 44, 45]]


def config(backend: str, **fields) -> EngineConfig:
    values = dict(backend=backend, tensor_parallel_size=1, dtype="float32", seed=0, enforce_eager=True,
                  max_model_len=MAX_LEN, kv_cache_bytes=2**26, temperature=1.0, num_threads=None, in_process=True)
    return EngineConfig(**{**values, **fields})


@pytest.fixture(scope="module")
def fake(tiny_qwen2) -> FakeEngine:
    return build_engine(str(tiny_qwen2), config("fake"), torch.device("cpu"))


def test_every_backend_is_registered_with_its_declarations():
    assert {"vllm", "hf", "fake"} <= set(ENGINES.names())
    assert ENGINES.get("vllm").tensor_parallel and ENGINES.get("vllm").adapter_rank(8) == 8
    assert not ENGINES.get("hf").tensor_parallel and ENGINES.get("hf").adapter_rank is None
    with pytest.raises(KeyError, match="unknown rollout engine 'sglang'; known: fake, hf, vllm"):
        build_engine("unused", config("sglang"), torch.device("cpu"))


def test_a_backend_is_one_subclass_of_the_contract():
    """What an engine must provide: every abstract method of RolloutEngine (the fake adds generate, and a load that
    first scores the streamed tokens generated so far)."""
    assert RolloutEngine.__abstractmethods__ == {"generate", "prompt_logprobs", "placement", "begin_load",
                                                 "load_bucket", "finish_load", "checkpoint_report", "abort"}
    assert issubclass(FakeEngine, RolloutEngine) and set(vars(FakeEngine)) & RolloutEngine.__abstractmethods__ == \
        {"generate", "begin_load"}


def test_fake_samples_come_from_their_seeds_alone(fake, tiny_qwen2, tmp_path):
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=20, seed=11, stop_token_ids=(1,))
    first = fake.generate(PROMPTS, sampling)
    assert first.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len({tuple(r) for r in first.response_ids}) == 9  # every sample its own draw
    assert set(first.finish_reasons) == {"stop", "length"}
    stops = {1} | fake.eos_ids  # the request's stop tokens and the model's EOS
    for ids, reason in zip(first.response_ids, first.finish_reasons):
        assert 1 <= len(ids) <= 20 and (reason == "stop") == (ids[-1] in stops) and not stops & set(ids[:-1])
    # a prompt's samples do not depend on the batch around it, nor on the weights the engine holds
    alone = fake.generate([PROMPTS[2]], SamplingConfig(n=3, temperature=1.0, max_new_tokens=20,
                                                       prompt_seeds=(11 + 2 * 3,), stop_token_ids=(1,)))
    assert alone.response_ids == first.response_ids[6:]
    other = build_engine(str(tiny_qwen2), config("fake"), torch.device("cpu"))
    with torch.no_grad():
        for param in other.model.parameters():
            param.mul_(1.5)
    moved = other.generate(PROMPTS, sampling)
    assert moved.response_ids == first.response_ids and moved.logprobs != first.logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_fake_logprobs_are_the_held_models_at_the_temperature(fake, tiny_qwen2, temperature):
    """The contract's log-prob, computed independently: one forward of transformers' model, no padding."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    batch = fake.generate(PROMPTS, SamplingConfig(n=2, temperature=temperature, max_new_tokens=12, seed=3))
    for i, response, logprobs in zip(batch.prompt_index, batch.response_ids, batch.logprobs):
        ids = torch.tensor([PROMPTS[i] + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float() / (temperature or 1.0), dim=-1)
        expected = logp[len(PROMPTS[i]) - 1:-1].gather(-1, ids[0, len(PROMPTS[i]):, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=2e-5, rtol=0)


def test_weights_load_in_one_session_of_buckets(fake, tiny_qwen2):
    """A session of buckets leaves the engine as a one-call load does, and its report says so."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    state = {name: tensor * 0.5 for name, tensor in model.state_dict().items() if name in fake.layout}
    engine = HFEngine(str(tiny_qwen2), dtype=torch.float32, device="cpu", seed=0, max_model_len=MAX_LEN)
    reference = engine.load_weights(state.items())
    fake.begin_load()
    names = sorted(state)
    for start in range(0, len(names), 3):
        fake.load_bucket(WeightBucket.pack([(n, state[n]) for n in names[start:start + 3]]))
    assert fake.finish_load()["parameters"] == reference["parameters"]


def test_abort_stops_a_running_generation_and_keeps_its_prefix(tiny_qwen2):
    """From another thread, mid-decode: every unfinished sample ends 'abort' with the tokens and log-probs
    an uninterrupted run has at those positions; the next call is not aborted."""
    engine = HFEngine(str(tiny_qwen2), dtype=torch.float32, device="cpu", seed=0, max_model_len=MAX_LEN)
    long = SamplingConfig(n=2, temperature=1.0, max_new_tokens=80, ignore_eos=True, seed=4)
    full = engine.generate(PROMPTS, long)
    started, real_forward = threading.Event(), engine._forward

    def forward(*args):
        if args[0].shape[1] == 1:  # a decode step: the generation is under way
            started.set()
        return real_forward(*args)

    engine._forward = forward
    box = []
    worker = threading.Thread(target=lambda: box.append(engine.generate(PROMPTS, long)))
    worker.start()
    started.wait(timeout=60)
    engine.abort()
    worker.join(timeout=60)
    aborted = box[0]
    assert set(aborted.finish_reasons) == {"abort"}
    for got, want, got_lp, want_lp in zip(aborted.response_ids, full.response_ids, aborted.logprobs, full.logprobs):
        assert 0 < len(got) < 80 and got == want[:len(got)] and got_lp == want_lp[:len(got)]
    assert engine.generate(PROMPTS, long).response_ids == full.response_ids
    assert engine.health().ok  # an in-process engine is as alive as the process


def test_an_abort_between_chunks_leaves_the_later_chunks_ungenerated(tiny_qwen2):
    """A request larger than one decode batch runs in chunks; an abort during the first ends the later ones
    without a token (they had not started), not with a token each."""
    engine = HFEngine(str(tiny_qwen2), dtype=torch.float32, device="cpu", seed=0, max_model_len=MAX_LEN,
                      max_batch_tokens=20)  # one prompt x n=2 per chunk
    real_decode = engine._decode

    def decode_then_abort(*args):
        rows = real_decode(*args)
        engine.abort()
        return rows

    engine._decode = decode_then_abort
    batch = engine.generate(PROMPTS, SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=1, ignore_eos=True))
    assert [len(r) for r in batch.response_ids] == [4, 4, 0, 0, 0, 0]
    assert batch.finish_reasons == ["length"] * 2 + ["abort"] * 4
