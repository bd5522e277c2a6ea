"""Rank script for the model-provider parity tests: one launch per parallel layout checks all four
architectures against HF transformers. Usage: _worker_parity.py TP PP MODELS_DIR OUT_DIR

For every architecture it loads the tiny HF checkpoint into the sharded Megatron model and records:
logits vs HF logits (last stage), padded-vocab logits, the HF -> Megatron -> HF round trip of every
tensor, an exported HF directory (sharded with an index) reloaded by transformers (weights and greedy
generations vs the source), the export re-loaded into Megatron from its index, and the value-head
variant (from a ForSequenceClassification checkpoint and from the causal LM) vs HF scores. With TP=1 and
PP=1 it also records the messages of the checkpoint errors.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
BATCH, SEQ = 2, 19


def inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


@torch.no_grad()
def forward(model, ids, pos):
    """The model's output on the last pipeline stage (None elsewhere), via Megatron's schedule for PP."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.eval()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return model(input_ids=ids, position_ids=pos, attention_mask=None)

    def step(data_iterator, chunk):
        out = chunk(input_ids=ids, position_ids=pos, attention_mask=None)
        return out, lambda output_tensor, non_loss_data=False: output_tensor

    stored = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model],
                                         num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                         forward_only=True, collect_non_loss_data=True)
    return stored[0] if ps.is_pipeline_last_stage() else None


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def round_trip(model, provider, source: Path) -> dict:
    from model_providers.hf_checkpoint import iter_hf_weights

    src = load_file(str(source / "model.safetensors"))
    got = list(iter_hf_weights(model, provider))
    names = [n for n, _ in got]
    return {"missing": sorted(set(src) - set(names)), "extra": sorted(set(names) - set(src)),
            "duplicates": len(names) - len(set(names)),
            "not_equal": sorted(n for n, t in got if n in src and not torch.equal(t, src[n]))}


def check_export(model, provider, source: Path, out: Path) -> dict:
    """Sharded export -> transformers (weights, greedy generations) and -> Megatron again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_providers.hf_checkpoint import export_hf_checkpoint, load_hf_weights

    export_hf_checkpoint(model, provider, out, source_dir=source, max_shard_bytes=500_000)
    result = {"files": sorted(p.name for p in out.iterdir())}
    if dist.get_rank() == 0:
        ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        exp = AutoModelForCausalLM.from_pretrained(out).eval()
        ref_sd, exp_sd = ref.state_dict(), exp.state_dict()
        result["weights_equal"] = ref_sd.keys() == exp_sd.keys() and all(
            torch.equal(ref_sd[k], exp_sd[k]) for k in ref_sd)
        tok = AutoTokenizer.from_pretrained(out, padding_side="left")
        prompts = tok(["What is 3 + 4?", "The quick brown"], return_tensors="pt", padding=True)
        kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        a, b = ref.generate(**prompts, **kwargs), exp.generate(**prompts, **kwargs)
        result["generations_equal"] = torch.equal(a, b)
        result["generated"] = a[:, prompts["input_ids"].shape[1]:].tolist()
    reloaded = provider.build_model()
    load_hf_weights(reloaded, provider, out)
    result["reload_equal"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), reloaded.parameters()))
    return result


def check_value_head(provider, rm_dir: Path, causal_dir: Path, ids, pos, out: Path) -> dict:
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from model_providers.value_head import export_reward_model, load_value_model

    result = {}
    rm_provider, rm = load_value_model(rm_dir)
    values = forward(rm, ids, pos)
    _, fresh = load_value_model(causal_dir)
    fresh_values = forward(fresh, ids, pos)
    if ps.is_pipeline_last_stage():
        hf_rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf_rm.score(hf_rm.model(input_ids=ids).last_hidden_state)
            hidden = AutoModelForCausalLM.from_pretrained(causal_dir, dtype=torch.float32).model(
                input_ids=ids).last_hidden_state
        result["value_shape"] = list(values.shape)
        result["value_max_diff"] = (values - ref).abs().max().item()
        head = fresh.output_layer.weight.detach()
        heads = [torch.empty_like(head) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(heads, head, group=ps.get_tensor_model_parallel_group())
        result["fresh_head_same_on_tp_ranks"] = all(torch.equal(h, head) for h in heads)
        result["fresh_head_std"] = head.std().item()
        result["fresh_value_max_diff"] = (fresh_values - hidden @ head.T).abs().max().item()
    export_reward_model(rm, rm_provider, out, source_dir=rm_dir)
    if dist.get_rank() == 0:
        src = load_file(str(rm_dir / "model.safetensors"))
        got = load_file(str(out / "model.safetensors"))
        result["rm_export_equal"] = src.keys() == got.keys() and all(torch.equal(src[k], got[k]) for k in src)
        result["rm_export_loads"] = type(AutoModelForSequenceClassification.from_pretrained(out)).__name__
    return result


def error_messages(provider, models: Path, scratch: Path) -> dict:
    """Messages of checkpoint errors: missing tensor and wrong shape (TP=1 only)."""
    from safetensors.torch import save_file

    from model_providers.hf_checkpoint import load_hf_weights

    src = models / "qwen2"
    tensors = load_file(str(src / "model.safetensors"))
    messages = {}
    for case, edit in {"missing_tensor": lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
                       "wrong_shape": lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                                                          torch.zeros(32, 128)})}.items():
        broken = scratch / case
        broken.mkdir(parents=True)
        edited = dict(tensors)
        edit(edited)
        save_file(edited, str(broken / "model.safetensors"))
        try:
            load_hf_weights(provider.build_model(), provider, broken)
            messages[case] = None
        except ValueError as err:
            messages[case] = str(err)
    return messages


def bf16_checks(models: Path) -> dict:
    """A bf16 model from an fp32 checkpoint: every parameter bf16, and its HF tensors equal the source's
    rounded to bf16 (the conversion adds no error of its own)."""
    from model_providers.hf_checkpoint import iter_hf_weights, load_hf_model

    provider, model = load_hf_model(models / "qwen2", params_dtype=torch.bfloat16)
    src = load_file(str(models / "qwen2" / "model.safetensors"))
    return {"param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "not_equal": sorted(n for n, t in iter_hf_weights(model, provider)
                                if not torch.equal(t, src[n].to(torch.bfloat16)))}


def main(tp: int, pp: int, models: Path, out_dir: Path, first_stage_layers: int) -> None:
    from megatron.core import parallel_state as ps

    from model_providers.hf_checkpoint import load_hf_model

    layout = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            num_layers_in_first_pipeline_stage=first_stage_layers or None)
    launch = init_parallel(layout, seed=3).launch
    result = {"last_stage": ps.is_pipeline_last_stage()}
    for arch in ARCHS:
        provider, model = load_hf_model(models / arch)
        vocab = provider.hf_config.vocab_size
        ids, pos = inputs(vocab)
        logits = forward(model, ids, pos)
        r = {"padded_vocab": provider.padded_vocab_size(tp),
             "layer_numbers": [layer.layer_number for layer in model.decoder.layers]}
        if logits is not None:
            from transformers import AutoModelForCausalLM

            full = gather_logits(logits)
            hf = AutoModelForCausalLM.from_pretrained(models / arch, dtype=torch.float32)
            with torch.no_grad():
                ref = hf(input_ids=ids).logits
            inv_freq = model.rotary_pos_emb.inv_freq
            r["inv_freq_max_diff"] = (inv_freq - hf.model.rotary_emb.inv_freq).abs().max().item()
            # Megatron's built-in Llama-3 scaling (original context fixed at 8192), to show it would differ.
            unscaled = 1.0 / provider.hf_config.rope_parameters["rope_theta"] ** (
                torch.arange(0, provider.head_dim, 2, dtype=torch.float32) / provider.head_dim)
            builtin = model.rotary_pos_emb._apply_scaling(unscaled)
            r["builtin_llama3_max_diff"] = (builtin - inv_freq).abs().max().item()
            r["logit_max_diff"] = (full[..., :vocab] - ref).abs().max().item()
            r["padded_logits_max_abs"] = full[..., vocab:].abs().max().item() if full.shape[-1] > vocab else 0.0
            r["logits_shape"] = list(full.shape)
        r["round_trip"] = round_trip(model, provider, models / arch)
        r["export"] = check_export(model, provider, models / arch, out_dir / f"export-{arch}")
        r["value"] = check_value_head(provider, models / f"{arch}-rm", models / arch, ids, pos,
                                      out_dir / f"rm-export-{arch}")
        result[arch] = r
    if tp == 1 and pp == 1:
        from model_providers import get_provider

        result["errors"] = error_messages(get_provider(models / "qwen2"), models, out_dir / "broken")
        result["bf16"] = bf16_checks(models)
    write_rank_result(out_dir, launch.rank, result)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
