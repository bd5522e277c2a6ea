"""The rollout engine: seeded sampling reproducible (same engine twice, and two independent engines on two
ranks), different seeds differ, n samples per prompt differ, finish reasons; input validation."""
from __future__ import annotations

import pytest

from megarlhf.config.rollout import RolloutConfig
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.rollout.engines import EngineConfig
from megarlhf.rollout.engines.vllm import VLLMEngine, vllm_logprobs_mode


def engine_config(**rollout) -> EngineConfig:
    return EngineConfig.from_rollout(RolloutConfig(**{"kv_cache_mb": 64, **rollout}), model_dtype="float32", seed=0,
                                     max_prompt_length=128)


@pytest.mark.slow  # one ~40 s launch per layout: make test-slow
@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_seeded_sampling_is_reproducible(rollout_run, layout):
    ranks = rollout_run(layout)
    for rank in ranks:
        s = rank["seeded"]
        assert s["same_seed_equal"] and s["other_seed_differs"] and s["samples_differ_within_prompt"]
        assert len(s["responses"]) == 8 * 3
    assert ranks[0]["seeded"]["responses"] == ranks[1]["seeded"]["responses"]  # independent engines (tp2)


@pytest.mark.slow  # shares the tp2 launch with test_seeded_sampling_is_reproducible: make test-slow
def test_sampled_rollouts_report_both_finish_reasons(rollout_run):
    for rank in rollout_run("tp2"):
        assert rank["before"]["finish_reasons"] == ["length", "stop"]


@pytest.mark.parametrize("field,value", [("n", 0), ("temperature", -1.0), ("max_new_tokens", 0)])
def test_sampling_config_errors_name_the_field(field, value):
    good = dict(n=1, temperature=1.0, max_new_tokens=4)
    with pytest.raises(ValueError, match=f"SamplingConfig.{field}="):
        SamplingConfig(**{**good, field: value}).validate()


def test_engine_config_comes_from_the_rollout_config():
    config = engine_config(temperature=0.7, max_new_tokens=64, dtype="bfloat16", kv_cache_mb=32)
    assert (config.dtype, config.max_model_len, config.kv_cache_bytes) == ("bfloat16", 192, 32 * 2**20)
    assert vllm_logprobs_mode(config.temperature) == "processed_logprobs"  # the trainer scores at T = 0.7
    assert vllm_logprobs_mode(engine_config(temperature=1.0).temperature) == "raw_logprobs"
    assert engine_config().dtype == "float32"  # rollout.dtype None: the model's


def test_engine_rejects_a_tp_size_that_is_neither_1_nor_the_world(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        VLLMEngine(str(tmp_path), engine_config(tensor_parallel_size=3))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        VLLMEngine(str(tmp_path), engine_config())



@pytest.mark.slow  # a second vLLM engine (~16 s)
def test_seeded_batch_larger_than_one_scheduler_step(tiny_qwen2, tmp_path):
    """More prompt tokens than vLLM schedules in one step: on CPU prompts must not be split across steps
    (vLLM would rewind a seeded CPU generator and fail); samples stay reproducible."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import json
        from megarlhf.rollout.engines import EngineConfig
        from megarlhf.rollout.engines.vllm import VLLMEngine
        from megarlhf.config.rollout import RolloutConfig
        from megarlhf.rollout.engines import SamplingConfig
        config = EngineConfig.from_rollout(RolloutConfig(kv_cache_mb=64, max_new_tokens=128), model_dtype="float32",
                                           seed=0, max_prompt_length=128)
        engine = VLLMEngine({str(tiny_qwen2)!r}, config)
        prompts = [[(7 * i + j) % 300 + 3 for j in range(100)] for i in range(64)]  # 6400 prompt tokens
        sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=11)
        first, second = engine.generate(prompts, sampling), engine.generate(prompts, sampling)
        print(json.dumps([len(first.response_ids), first.response_ids == second.response_ids]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[128, true]"


def test_an_engine_core_that_dies_is_reported_unhealthy(tiny_qwen2, tmp_path):
    """An engine in its own process (as on a disaggregated engine rank) reports its health; once its engine
    core is killed (SIGKILL), health() says so instead of the next call hanging or crashing obscurely."""
    import json
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import json, os, signal, time
        from megarlhf.config.rollout import RolloutConfig
        from megarlhf.rollout.engines import EngineConfig
        from megarlhf.rollout.engines.vllm import VLLMEngine
        if __name__ == "__main__":
            config = EngineConfig.from_rollout(RolloutConfig(kv_cache_mb=32, max_new_tokens=8), model_dtype="float32",
                                               seed=0, max_prompt_length=32, in_process=False)
            engine = VLLMEngine({str(tiny_qwen2)!r}, config)
            before = engine.health()
            cores = engine.engine_processes()
            for core in cores:
                os.kill(core.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while engine.health().ok and time.monotonic() < deadline:
                time.sleep(0.1)
            after = engine.health()
            print(json.dumps([before.ok, len(cores) > 0, after.ok, after.detail]))
            os._exit(0)
    """)
    (tmp_path / "health.py").write_text(script)
    proc = subprocess.run([sys.executable, str(tmp_path / "health.py")], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, killed, after, detail = json.loads(proc.stdout.strip().splitlines()[-1])
    assert before and killed and not after and "engine core process died" in detail
