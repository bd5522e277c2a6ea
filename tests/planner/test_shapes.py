"""Model shapes: presets and config.json parsing against transformers' own models (built on the meta
device), and per-rank parameter counts against real Megatron-Core models at TP=2 and PP=2."""
import json
from pathlib import Path

import pytest
import torch

from megarlhf.planner.shapes import PRESETS, ModelShape, resolve_shape
from megarlhf.testing.launch import read_rank_results, run_torchrun
from model_providers.tiny_models import make_tiny_model

WORKER = Path(__file__).with_name("_worker_params.py")


def _hf_param_count(values: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(values["model_type"], **{k: v for k, v in values.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_count_matches_transformers(name):
    shape = ModelShape.from_hf_config(PRESETS[name], name)
    assert shape.total_params() == _hf_param_count(PRESETS[name])


def test_published_sizes():
    billions = {name: ModelShape.from_hf_config(v, name).total_params() / 1e9 for name, v in PRESETS.items()}
    assert billions == pytest.approx({"Qwen2.5-0.5B": 0.494, "Qwen2.5-1.5B": 1.544, "Qwen2.5-7B": 7.616,
                                      "Llama-3.1-8B": 8.030, "SmolLM2-135M": 0.1345, "Qwen3-30B-A3B": 30.532},
                                     abs=1e-3)


def test_resolve_shape_sources(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(PRESETS["Qwen2.5-0.5B"], hidden_size=1024)))
    shape, source = resolve_shape(str(tmp_path / "m"))
    assert shape.hidden_size == 1024 and "config.json" in source
    shape, source = resolve_shape("somewhere/Qwen2.5-7B-Instruct")  # absent checkpoint: preset by name
    assert shape.hidden_size == 3584 and "preset" in source
    assert resolve_shape(str(tmp_path / "m"), arch="Llama-3.1-8B")[0].hidden_size == 4096
    with pytest.raises(ValueError, match="no config.json and its name matches no preset"):
        resolve_shape(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="does not divide"):
        shape.check_layout(3, 1)
    moe = ModelShape.from_hf_config(PRESETS["Qwen3-30B-A3B"], "Qwen3-30B-A3B")
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 / tensor_model_parallel_size=1 do not divide "
                                         "the 128 experts"):
        moe.check_layout(1, 1, 3)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        shape.check_layout(1, 1, 2)


@pytest.mark.slow  # builds Megatron models at several layouts (~20 s)
def test_per_rank_params_match_megatron(tmp_path):
    tied = make_tiny_model("qwen2", tmp_path / "tied", seed=0, tie_word_embeddings=True)
    untied = make_tiny_model("qwen2", tmp_path / "untied", seed=0, tie_word_embeddings=False, num_hidden_layers=4)
    # MoE: Qwen3-MoE with a dense first layer (3 layers: PP2 splits them 2 + 1 with the first stage given 2),
    # Qwen2-MoE with its shared expert
    qwen3_moe = make_tiny_model("qwen3_moe", tmp_path / "qwen3_moe", seed=0, num_hidden_layers=4)
    qwen2_moe = make_tiny_model("qwen2_moe", tmp_path / "qwen2_moe", seed=0)
    run_torchrun(WORKER, 2, [str(tmp_path / "out"), str(tied), str(untied), str(qwen3_moe), str(qwen2_moe)],
                 timeout_s=300)
    seen = set()
    for result in read_rank_results(tmp_path / "out", 2):
        for entry in result["counts"]:
            shape, _ = resolve_shape(entry["model"])
            layout = (entry["tp"], entry["pp"], entry["stage"])
            assert entry["params"] == shape.params_per_rank(*layout, ep=entry["ep"]), entry
            assert entry["experts"] == shape.expert_params_per_rank(*layout, entry["ep"]), entry
            seen.add((Path(entry["model"]).name, entry["ep"]))
    assert {("qwen3_moe", 2), ("qwen2_moe", 2), ("qwen3_moe", 1)} <= seen
