"""Rank script for the mixture-of-experts parity tests: one launch per layout checks the three MoE
architectures against HF transformers. Usage: _worker_moe_parity.py TP PP EP FIRST_STAGE_LAYERS MODELS OUT

For every architecture: logits vs HF fp32 logits (last stage), the HF -> Megatron -> HF round trip of every
tensor (experts gathered over the expert-parallel group), an exported HF directory reloaded by transformers
(weights and greedy generations vs the source) and by megarlhf, and which global experts this rank holds.
At TP=PP=EP=1 it also records the errors of bad inputs (a checkpoint missing one expert tensor; EP not
dividing the experts; unsupported routers) and whether anything was written.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from _worker_parity import check_export, forward, gather_logits, inputs, round_trip

from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


def local_experts(model) -> list[int]:
    """The global expert index of each local expert of this rank (first MoE layer)."""
    from megatron.core import parallel_state as ps

    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            count = len(experts.local_experts)
            return [ps.get_expert_model_parallel_rank() * count + i for i in range(count)]
    return []


def bad_inputs(models: Path, scratch: Path) -> dict:
    from safetensors.torch import load_file, save_file

    from model_providers import get_provider
    from model_providers.hf_checkpoint import load_hf_weights
    from model_providers.tiny_models import tiny_config
    from megarlhf.config.parallel import ParallelConfig as Layout

    messages = {}
    src = models / "qwen3_moe"
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    broken = scratch / "missing_expert"
    broken.mkdir(parents=True)
    save_file(tensors, str(broken / "model.safetensors"))
    provider = get_provider(src)
    model = provider.build_model()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        load_hf_weights(model, provider, broken)
    except ValueError as err:
        messages["missing_expert"] = str(err)
    messages["missing_expert_wrote"] = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    try:
        provider.transformer_config(Layout(expert_model_parallel_size=3))
    except ValueError as err:
        messages["ep_not_dividing"] = str(err)
    for field, value in (("n_group", 4), ("scoring_func", "sigmoid"), ("router_jitter_noise", 0.1)):
        try:
            get_provider(tiny_config("qwen3_moe", **{field: value}))
        except ValueError as err:
            messages[f"router_{field}"] = str(err)
    try:
        get_provider(tiny_config("qwen2")).transformer_config(Layout(expert_model_parallel_size=2))
    except ValueError as err:
        messages["ep_on_dense"] = str(err)
    return messages


def main(tp: int, pp: int, ep: int, first_stage_layers: int, models: Path, out_dir: Path) -> None:
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from model_providers.hf_checkpoint import load_hf_model

    layout = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, num_layers_in_first_pipeline_stage=first_stage_layers or None)
    launch = init_parallel(layout, seed=3).launch
    result = {"last_stage": ps.is_pipeline_last_stage()}
    for arch in ARCHS:
        provider, model = load_hf_model(models / arch)
        ids, pos = inputs(provider.hf_config.vocab_size)
        if tp > 1:  # at TP > 1 the MoE model runs sequence-parallel: the sequence splits evenly over TP ranks
            keep = ids.shape[1] // tp * tp
            ids, pos = ids[:, :keep], pos[:, :keep]
        logits = forward(model, ids, pos)
        r = {"experts": local_experts(model), "layers": [layer.layer_number for layer in model.decoder.layers]}
        if logits is not None:
            full = gather_logits(logits)[..., :provider.hf_config.vocab_size]
            hf = AutoModelForCausalLM.from_pretrained(models / arch, dtype=torch.float32)
            with torch.no_grad():
                ref = hf(input_ids=ids).logits
            r["logit_max_diff"] = (full - ref).abs().max().item()
            r["logit_max_abs"] = ref.abs().max().item()
        r["round_trip"] = round_trip(model, provider, models / arch)
        r["export"] = check_export(model, provider, models / arch, out_dir / f"export-{arch}")
        result[arch] = r
    if tp == pp == ep == 1:
        result["errors"] = bad_inputs(models, out_dir / "broken")
    write_rank_result(out_dir, launch.rank, result)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]), Path(sys.argv[6]))
