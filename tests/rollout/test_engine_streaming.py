"""Streaming generation (megarlhf.rollout.engines.streaming): single samples go in, each comes out when it
finishes, an interrupt returns the tokens so far, and a load between two steps reaches the samples in flight.

Against each backend's own batch generation with the same seeds: the fake engine and vLLM batch continuously
(the shortest sample first), the transformers engine through the contract's BatchStream (all at once)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from megarlhf.rollout.engines import SamplingConfig, build_engine
from megarlhf.rollout.engines.streaming import SampleRequest

from test_engines import PROMPTS, config

SAMPLING = SamplingConfig(n=1, temperature=1.0, max_new_tokens=20, stop_token_ids=(1,))
SEEDS = [101, 202, 303]


def _requests(limit: int = 20) -> list[SampleRequest]:
    return [SampleRequest(("prompt", i), tuple(p), limit, seed) for i, (p, seed) in enumerate(zip(PROMPTS, SEEDS))]


def _generated(engine):
    return engine.generate(PROMPTS, SamplingConfig(**{**vars(SAMPLING), "prompt_seeds": tuple(SEEDS)}))


def _drain(engine) -> list:
    out = []
    while engine.in_flight():
        out.append(engine.advance())
    return out


@pytest.mark.parametrize("backend", ["fake", "hf"])
def test_streamed_samples_equal_the_batch_generated_ones(tiny_qwen2, backend):
    engine = build_engine(str(tiny_qwen2), config(backend), torch.device("cpu"))
    batch = _generated(engine)
    engine.submit(_requests(), SAMPLING)
    assert engine.in_flight() == 3
    rounds = _drain(engine)
    outputs = {o.key: o for r in rounds for o in r}
    assert sorted(outputs) == [("prompt", i) for i in range(3)] and engine.in_flight() == 0
    for i in range(3):
        got = outputs["prompt", i]
        assert got.token_ids == batch.response_ids[i] and got.finish_reason == batch.finish_reasons[i]
        torch.testing.assert_close(got.logprobs, batch.logprobs[i], rtol=0, atol=1e-5)
    if backend == "fake":  # continuous: each advance returns what finished first, the shortest
        lengths = [[len(o.token_ids) for o in r] for r in rounds]
        assert [min(r) for r in lengths] == sorted(min(r) for r in lengths) and len(rounds) > 1
    else:  # batch generation under the contract: everything at once
        assert len(rounds) == 1
    assert engine.advance() == []


def test_an_interrupt_returns_the_tokens_so_far_and_new_weights_reach_the_samples_resubmitted(tiny_qwen2):
    """Fake engine: after the first sample finished, the others are interrupted with a prefix of what they would
    have become, scored by the weights that generated it. A load is refused while samples are in flight; after
    the interrupt new weights are loaded and a sample submitted again as prompt + prefix: its new tokens are
    scored by the new weights."""
    engine = build_engine(str(tiny_qwen2), config("fake"), torch.device("cpu"))
    full = _generated(engine)
    engine.submit(_requests(), SAMPLING)
    first = engine.advance()
    with pytest.raises(RuntimeError, match="FakeEngine.begin_load: 2 streamed samples are in flight; interrupt"):
        engine.load_weights([])
    with pytest.raises(RuntimeError, match="FakeEngine.generate: 2 streamed samples are in flight"):
        _generated(engine)
    partial = {o.key: o for o in engine.interrupt()}
    assert engine.in_flight() == 0 and len(first) == 1 and len(partial) == 2
    for (_, i), o in partial.items():
        assert o.finish_reason == "abort" and o.token_ids == full.response_ids[i][:len(o.token_ids)]
        torch.testing.assert_close(o.logprobs, full.logprobs[i][:len(o.token_ids)], rtol=0, atol=1e-5)
    engine.load_weights([(name, t * 1.5) for name, t in engine.model.state_dict().items()
                         if name in engine.layout and "embed" not in name])
    (_, i), o = max(partial.items(), key=lambda item: len(item[1].token_ids))
    prompt = tuple(PROMPTS[i]) + tuple(o.token_ids)
    engine.submit([SampleRequest("again", prompt, 20 - len(o.token_ids), 7)], SAMPLING)
    (again,) = [o for r in _drain(engine) for o in r]
    checkpoint = build_engine(str(tiny_qwen2), config("fake"), torch.device("cpu"))  # the old weights
    new, old = (e.teacher_forced([list(prompt) + again.token_ids], 1.0)[0][len(prompt) - 1:]
                for e in (engine, checkpoint))
    torch.testing.assert_close(again.logprobs, new, rtol=0, atol=1e-5)
    assert again.token_ids and len(again.token_ids) <= 20 - len(o.token_ids)
    assert max(abs(a - b) for a, b in zip(new, old)) > 1e-3


def test_unseeded_samples_differ_and_mixed_seeding_is_refused(tiny_qwen2):
    fake = build_engine(str(tiny_qwen2), config("fake"), torch.device("cpu"))
    fake.submit([SampleRequest(k, (5, 9), 20) for k in range(4)], SAMPLING)
    assert len({tuple(o.token_ids) for r in _drain(fake) for o in r}) == 4
    hf = build_engine(str(tiny_qwen2), config("hf"), torch.device("cpu"))
    hf.submit([SampleRequest("seeded", (5, 9), 4, 1)], SAMPLING)
    with pytest.raises(ValueError, match=r"some are seeded, some not \(\['unseeded'\] ...\); seed all of them or none"):
        hf.submit([SampleRequest("unseeded", (5, 9), 4)], SAMPLING)
    assert hf.in_flight() == 1 and [o.key for o in hf.advance()] == ["seeded"]


def test_requests_are_checked():
    with pytest.raises(ValueError, match="SampleRequest 'a': empty prompt"):
        SampleRequest("a", (), 4)
    with pytest.raises(ValueError, match=r"SampleRequest 'b': max_new_tokens=0 \(must be >= 1\)"):
        SampleRequest("b", (3,), 0)


def test_vllm_streams_continuously_and_refuses_to_load_under_samples_in_flight(tiny_qwen2, tmp_path):
    """vLLM with its engine core in a process of its own (as on an engine rank): streamed samples equal the batch
    generated ones with the same seeds and the shortest comes out first. While samples are in flight a load, the
    probe and a batch generation are refused (the engine core would step them under half-loaded weights, or
    steal their outputs); interrupted, each returns its tokens so far, and once new weights are in, one submitted
    again as prompt + prefix goes on from there as a batch generation of that prompt does."""
    script = textwrap.dedent(f"""
        import json, os
        from safetensors.torch import load_file
        from megarlhf.config.rollout import RolloutConfig
        from megarlhf.rollout.engines import EngineConfig, SamplingConfig
        from megarlhf.rollout.engines.streaming import SampleRequest
        from megarlhf.rollout.engines.vllm import VLLMEngine

        def refusal(call):
            try:
                call()
            except RuntimeError as err:
                return str(err)

        if __name__ == "__main__":
            config = EngineConfig.from_rollout(RolloutConfig(kv_cache_mb=32, max_new_tokens=24),
                                               model_dtype="float32", seed=0, max_prompt_length=32, in_process=False)
            engine = VLLMEngine({str(tiny_qwen2)!r}, config)
            weights = list(load_file(os.path.join({str(tiny_qwen2)!r}, "model.safetensors")).items())
            prompts, seeds = {PROMPTS!r} + [[9, 8, 7]], [101, 202, 303, 404]
            sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=24, stop_token_ids=(1, 2, 3, 4, 5))
            batch = engine.generate(prompts, SamplingConfig(**{{**vars(sampling), "prompt_seeds": tuple(seeds)}}))
            requests = [SampleRequest(i, tuple(p), 24, s) for i, (p, s) in enumerate(zip(prompts, seeds))]
            engine.submit(requests, sampling)
            rounds = []
            while engine.in_flight():
                rounds.append([[o.key, o.token_ids, o.finish_reason] for o in engine.advance()])
            engine.submit(requests, sampling)
            engine.advance()  # the first to finish; the others are interrupted
            refused = [refusal(lambda: engine.generate(prompts, sampling)),
                       refusal(lambda: engine.load_weights(weights)),
                       refusal(lambda: engine.prompt_logprobs([[5, 9, 11]]))]
            partial = [[o.key, o.token_ids, o.finish_reason] for o in engine.interrupt()]
            engine.load_weights([(name, t * 1.25) for name, t in weights])
            key, prefix, _ = max(partial, key=lambda p: len(p[1]))
            greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=24 - len(prefix))
            engine.submit([SampleRequest("again", tuple(prompts[key] + prefix), 24 - len(prefix))], greedy)
            (again,) = engine.advance()
            reference = engine.generate([prompts[key] + prefix], greedy)
            print("RESULT", json.dumps([batch.response_ids, batch.finish_reasons, rounds, refused, partial,
                                        [again.token_ids, again.logprobs, reference.response_ids[0],
                                         reference.logprobs[0]]]))
            engine.close()
            os._exit(0)
    """)
    (tmp_path / "stream.py").write_text(script)
    proc = subprocess.run([sys.executable, str(tmp_path / "stream.py")], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    responses, reasons, rounds, refused, partial, (again, again_logprobs, reference, reference_logprobs) = out
    streamed = {key: (ids, reason) for r in rounds for key, ids, reason in r}
    assert streamed == {i: (responses[i], reasons[i]) for i in range(4)}
    finished_first = [len(ids) for _, ids, _ in rounds[0]]
    assert max(finished_first) <= min(len(ids) for r in rounds[1:] for _, ids, _ in r)
    assert [r.split(":")[0] for r in refused] == ["VLLMEngine.generate", "VLLMEngine.load_weights",
                                                  "VLLMEngine.prompt_logprobs"]
    assert all("streamed samples are in flight; interrupt them first" in r for r in refused)
    assert 1 <= len(partial) <= 3 and len({k for k, _, _ in partial}) == len(partial)
    assert all(reason == "abort" and ids == responses[k][:len(ids)] for k, ids, reason in partial)
    assert again == reference and again
    assert max(abs(a - b) for a, b in zip(again_logprobs, reference_logprobs)) < 1e-4
