"""Weight sync Megatron -> vLLM: bitwise-equal engine parameters (fingerprints), engine == trainer after every sync (greedy
generations and sampled-token log-probs vs the trainer's own decoding and teacher forcing), before and
after 3 AdamW steps, at trainer TP=1 and TP=2; corrupted syncs stop with the tensor's name."""
from __future__ import annotations

import pytest
import torch

from megarlhf.config.rollout import WeightSyncConfig
from megarlhf.rollout.engines.weights import fused_placement
from megarlhf.rollout.sync.weights import compare_fingerprints, weight_buckets

LAYOUTS = ("tp1", "tp2")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("phase", ["before", "after"])
def test_engine_matches_trainer(rollout_run, layout, phase):
    for rank in rollout_run(layout):
        r = rank[phase]
        assert r["greedy_prompts"] == 64 and r["greedy_equal"] == 64, r
        assert r["sampled_tokens"] > 64 * 2 * 4
        assert r["logprob_max_diff"] <= 1e-4, r
        assert r["greedy_finish"] == ["length"]  # ignore_eos + max_new_tokens


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_changed_weights_and_resync_verified(rollout_run, layout):
    for rank in rollout_run(layout):
        assert rank["losses"][2] < rank["losses"][0] - 0.5  # the re-sync really had new weights to move
        calibration = rank["calibration"]  # fp32: the floors apply, the calibration gap is far below them
        assert calibration["gates/calibration_probe_max"] < 1e-4 and calibration["gates/probe_max"] == 1e-4
        assert calibration["gates/calibration_checkpoint_bitwise"] == 1.0
        assert 0 < calibration["gates/calibration_natural_max"] < 1e-4 and calibration["gates/step0_max"] == 1e-3
        # vLLM warned "RotaryEmbedding / ParallelLMHead: Failed to load weights" on every correct sync
        assert rank["reload_warnings"] == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_calibration_refuses_a_conversion_one_ulp_off(rollout_run, layout):
    """The actor's embedding one fp32 ulp off in one element (on the first rank's shard at TP=2): the
    engine's own load of the checkpoint differs from the trainer's conversion, and every rank stops."""
    for rank in rollout_run(layout):
        message = rank["converter_fault"]
        assert message is not None and "the engine's own load of model.path vs the trainer's conversion" in message
        assert "model.embed_tokens.weight" in message and "a conversion error" in message
        # right after calibration the engine holds what a sync would send, bit for bit: nothing is sent
        assert rank["sync0"]["weight_sync/skipped"] == 1.0 and "weight_sync/bytes" not in rank["sync0"]
        m = rank["sync1"]
        assert m["weight_sync/skipped"] == 0.0
        assert m["weight_sync/tensors"] == 26  # 2 layers x 12 + embedding + final norm (tied head)
        assert m["weight_sync/bytes"] == 1380864  # 345216 fp32 values of the tiny qwen2
        assert m["weight_sync/probe_max_abs_diff"] <= 1e-4
        assert m["time/weight_sync_s"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_corrupted_sync_names_the_tensor(rollout_run, layout):
    """tp2 runs one TP=1 engine per rank (its parameters fingerprinted, fused qkv / gate_up predicted by the
    trainer); tp1 one TP=2 engine (what its loader received is fingerprinted, and whether each layer was
    processed after loading)."""
    for rank in rollout_run(layout):
        m = rank["corrupted"]
        assert m["clean_after"] is None
        if layout == "tp2":
            assert "engine parameter model.layers.1.mlp.down_proj.weight" in m["perturbed"]
            assert "engine parameter model.layers.0.self_attn.qkv_proj.weight" in m["skipped"]
            assert "model.layers.1." in m["stale_layer"]
            assert "engine layer lm_head was not processed after this sync's load" in m["tied_head_unprocessed"]
        else:
            assert "engine parameter model.layers.1.mlp.down_proj.weight" in m["perturbed"]
            assert "no engine parameter holds the trainer's model.layers.0.self_attn.k_proj.weight" in m["skipped"]
            assert "no engine parameter holds the trainer's model.layers.1." in m["stale_layer"]
            assert "engine layer lm_head was not processed after this sync's load" in m["tied_head_unprocessed"]


def test_engine_placement_of_fused_parameters():
    shapes = {"m.l.q_proj.weight": (4, 2), "m.l.k_proj.weight": (2, 2), "m.l.v_proj.weight": (2, 2),
              "m.l.q_proj.bias": (4,), "m.l.k_proj.bias": (2,), "m.l.v_proj.bias": (2,), "m.norm.weight": (2,)}
    placement = fused_placement(shapes, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert placement == {"m.l.q_proj.weight": ("m.l.qkv_proj.weight", 0), "m.l.k_proj.weight": ("m.l.qkv_proj.weight", 8),
                         "m.l.v_proj.weight": ("m.l.qkv_proj.weight", 12), "m.l.q_proj.bias": ("m.l.qkv_proj.bias", 0),
                         "m.l.k_proj.bias": ("m.l.qkv_proj.bias", 4), "m.l.v_proj.bias": ("m.l.qkv_proj.bias", 6),
                         "m.norm.weight": ("m.norm.weight", 0)}
    with pytest.raises(ValueError, match=r"m.l.v_proj.weight without \['m.l.k_proj.weight'\]"):
        fused_placement({"m.l.q_proj.weight": (4, 2), "m.l.v_proj.weight": (2, 2)},
                         {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})


def test_compare_fingerprints_reports_every_kind_of_difference():
    expected = {"x": (1, 2), "y": (3, 4), "z": (5, 6), "emb": (7, 8)}
    report = {"parameters": {"x": [1, 2], "y": [3, 5], "extra": [0, 0], "emb": [7, 8]},
              "processed": {"x": [9, 9], "head": [7, 8]}, "aliases": {"head": "emb"},
              "problems": ["engine layer h was not processed after this sync's load"]}
    problems = compare_fingerprints(expected, report)
    assert problems[0] == report["problems"][0]
    assert problems[1] == "engine parameter y (as the engine holds it) differs from the trainer's: fingerprint " \
                          "00000003/00000005, trainer 00000003/00000004"
    assert problems[2] == "engine parameter extra (as the engine holds it) matches no tensor the trainer sent"
    assert problems[3].startswith("engine parameter x (as processed for its kernels) differs")
    assert problems[4] == "no engine parameter holds the trainer's z"
    assert len(problems) == 5  # the tied head ("head", an alias of "emb") matches
    clean = {"parameters": {k: list(v) for k, v in expected.items()}, "processed": {}, "aliases": {}, "problems": []}
    assert compare_fingerprints(expected, clean) == []


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="bucket_mb"):
        WeightSyncConfig(bucket_mb=0)
    with pytest.raises(ValueError, match="probe_length"):
        WeightSyncConfig(probe_length=1)


def test_buckets_are_bounded_and_keep_order():
    mib = 2**20
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([mib // 2, mib // 2, mib // 4, 3 * mib])]
    stats = {}
    buckets = [[name for name, _ in b] for b in weight_buckets(iter(tensors), 1.0, stats)]
    assert buckets == [["t0", "t1"], ["t2"], ["t3"]]  # a tensor larger than the limit travels alone
    assert stats == {"buckets": 3, "bytes": 4 * mib + mib // 4, "max_bucket_bytes": 3 * mib}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sync_streams_in_bounded_buckets(rollout_run, layout):
    limit = int(0.25 * 2**20)  # the worker's bucket_mb
    for rank in rollout_run(layout):
        m = rank["sync1"]
        assert m["weight_sync/buckets"] >= 5
        assert m["weight_sync/max_bucket_bytes"] <= limit


def test_the_probe_reaches_the_runs_longest_sequence_and_catches_a_late_fault(tmp_path):
    """An engine whose attention goes wrong only past position 100 (a sliding window of 100 tokens that the
    trainer does not have: the kind of fault a RoPE scaling boundary or window makes) passes a probe of
    64-token sequences and fails one that also scores a sequence as long as the run's longest (159 tokens
    where the engines hold 160: one is left for the token an engine generates)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarlhf.rollout.sync.gates import FLOORS
    from megarlhf.rollout.engines.hf import HFEngine
    from megarlhf.rollout.sync.weights import probe_problems, probe_sequences
    from model_providers.tiny_models import make_tiny_model

    model_dir = make_tiny_model("mistral", tmp_path / "mistral", seed=0)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # the trainer's stand-in
    engine = HFEngine(str(model_dir), dtype=torch.float32, device="cpu", seed=0, max_model_len=160)
    engine.model.config.sliding_window = 100  # wrong from token 101 on

    def verdict(config):
        probe = probe_sequences(reference.config.vocab_size, config, longest=159)
        ids = torch.tensor([s + [0] * (159 - len(s)) for s in probe])
        with torch.no_grad():
            logp = torch.log_softmax(reference(input_ids=ids).logits.float(), -1)
        trainer = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        return [len(s) for s in probe], probe_problems(trainer, engine.prompt_logprobs(probe), FLOORS["float32"])

    lengths, (_, _, problems) = verdict(WeightSyncConfig(probe_max_length=0))
    assert lengths == [64] * 4 and problems == []
    lengths, (_, _, problems) = verdict(WeightSyncConfig(probe_max_length=120))
    assert lengths == [64] * 4 + [120]  # capped: still past the window
    assert problems and "probe sequence 4 of 120 tokens" in problems[0]
    lengths, (worst, _, problems) = verdict(WeightSyncConfig())
    assert lengths == [64] * 4 + [159]
    assert problems and "(gates.probe_max)" in problems[0] and "probe sequence 4 of 159 tokens" in problems[0]


def test_the_probe_fits_engines_shorter_than_its_sequences(tmp_path):
    """A run of 16-token prompts and 16-token responses has engines of 32 positions: the 64-token probe used
    to exceed them and stop the run at start-up, blaming "rollout prompt 0". The probe's sequences now stop
    at the run's longest, and a sequence too long to score is named as such."""
    import torch

    from megarlhf.rollout.engines.hf import HFEngine
    from megarlhf.rollout.sync.weights import probe_sequences
    from model_providers.tiny_models import make_tiny_model

    model_dir = make_tiny_model("qwen2", tmp_path / "qwen2", seed=0)
    engine = HFEngine(str(model_dir), dtype=torch.float32, device="cpu", seed=0, max_model_len=32)
    probe = probe_sequences(384, WeightSyncConfig(), longest=31)
    assert [len(s) for s in probe] == [31] * 4
    assert [len(row) for row in engine.prompt_logprobs(probe)] == [30] * 4
    with pytest.raises(ValueError, match="sequence to score 1 has 32 tokens; max_model_len=32"):
        engine.prompt_logprobs([[1, 2], [3] * 32])


def test_the_reload_logger_is_the_one_vllm_warns_on():
    from _worker_rollout import ReloadWarnings

    from megarlhf.rollout.engines.weights import RELOAD_LOGGER

    assert ReloadWarnings.LOGGER == RELOAD_LOGGER
    import vllm.model_executor.model_loader.reload.layerwise as layerwise

    assert layerwise.logger.name == RELOAD_LOGGER


def test_a_prompt_and_response_beyond_the_models_positions_is_named_before_an_engine_starts(tiny_qwen2):
    """data.max_prompt_length + the response budget beyond max_position_embeddings (256 for the tiny model)
    used to stop inside the HF engine as "an error inside megarlhf"; it is the recipe's, named by its keys."""
    from megarlhf.config import RunConfig, load_config
    from megarlhf.core.errors import ConfigError
    from megarlhf.rollout.phase import engine_config

    fits = load_config(RunConfig, None, [f"model.path={tiny_qwen2}", "data.train_path=x.jsonl",
                                         "data.max_prompt_length=200", "rollout.max_new_tokens=56"])
    assert engine_config(fits).max_model_len == 256
    too_long = load_config(RunConfig, None, [f"model.path={tiny_qwen2}", "data.train_path=x.jsonl",
                                             "data.max_prompt_length=200", "rollout.max_new_tokens=57"])
    with pytest.raises(ConfigError, match=r"data.max_prompt_length=200 plus the response budget 57 .* is 257 "
                                          r"tokens, more than the 256 positions"):
        engine_config(too_long)
