"""Rank script of the LoRA tests. Usage: _worker_lora.py TP PP MODEL_DIR ADAPTER_DIR OUT_DIR [OPTION[,OPTION]]

OPTION: ``recompute`` (Megatron's full activation recomputation, every layer), ``save`` (also writes a
distributed checkpoint of the model with its adapters to OUT_DIR/ckpt), ``load=DIR`` (the adapters come
from that checkpoint, saved at another layout, instead of ADAPTER_DIR) or ``canonical`` (one adapter per
projection of the fused q/k/v and gate/up layers: ``model.lora.canonical``).

Builds the tiny model at (TP, PP), attaches LoRA (rank 4, alpha 8, every target), loads the PEFT adapter
of ADAPTER_DIR, and runs one forward + backward of ``sum(logits * W)`` (W seeded) through Megatron's
schedule. Writes, from the ranks that hold them: the logits (``logits.pt``), the logits with adapters
off (``base_logits.pt``), the adapters' gradients in PEFT names (``grads.safetensors``, gathered like
the adapters), the adapters re-exported as PEFT (``adapter/``) and the merged HF export (``merged/``).
At TP=PP=1 it also records the messages of bad LoRA settings (``errors.json``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megarlhf.config.parallel import ParallelConfig
from megarlhf.config.model import LoRAConfig
from parallel.lora import adapters_disabled, adapters_of
from parallel.runtime import init_parallel

LORA = LoRAConfig(rank=4, alpha=8.0)
BATCH, SEQ = 2, 11


def inputs(vocab: int):
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    weights = torch.randn(BATCH, SEQ, vocab, generator=torch.Generator().manual_seed(8))
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1), weights


def run(model, ids, pos, weights, vocab: int, backward: bool):
    """Logits [B, S, vocab] on the last stage (None elsewhere); with ``backward`` the gradient of
    ``sum(logits * weights)`` reaches every parameter that requires it."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    kept = {}
    # an explicit causal mask: Megatron's default one is made on "cuda" inside the recomputed chunk, where
    # the CPU layer's device rewrite does not reach (autograd functions run outside torch-function modes)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)

    def step(data_iterator, chunk):
        out = chunk(input_ids=ids, position_ids=pos, attention_mask=causal)

        def loss(output_tensor, non_loss_data=False):
            logits = gather_from_tensor_model_parallel_region(output_tensor)[..., :vocab]
            kept["logits"] = logits.detach()
            if not backward:
                return logits
            value = (logits * weights).sum()
            return value, {"loss": value.detach()}
        return out, loss

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model], num_microbatches=1,
                                seq_length=SEQ, micro_batch_size=BATCH, forward_only=not backward,
                                collect_non_loss_data=not backward)
    return kept.get("logits") if ps.is_pipeline_last_stage() else None


def gradients_as_peft(model, provider, lora: LoRAConfig) -> dict:
    """The adapters' gradients, gathered and named as PEFT names the factors."""
    from model_providers.hf_checkpoint import iter_hf_weights
    from model_providers.peft_adapter import adapter_table

    params = [p for a in adapters_of(model) for p in (a.A, a.B)]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return {n: t.clone() for n, t in iter_hf_weights(model, provider, table=adapter_table(provider, lora))}
    finally:
        for p, data in zip(params, saved):
            p.data = data


def error_messages(model_dir: Path) -> dict:
    from model_providers.hf_checkpoint import load_hf_model
    from model_providers.peft_adapter import load_peft_adapter
    from parallel.lora import attach_lora

    messages = {}
    for name, kwargs in {"rank0": dict(rank=0), "unknown_target": dict(targets=["linear_qkv", "q_proj"]),
                         "empty_targets": dict(targets=[]), "alpha": dict(alpha=0.0)}.items():
        try:
            LoRAConfig(**kwargs)
        except ValueError as err:
            messages[name] = str(err)
    _, model = load_hf_model(model_dir)
    try:
        attach_lora(model, LoRAConfig(rank=10_000), seed=0)
    except ValueError as err:
        messages["rank_too_large"] = str(err)
    _, model = load_hf_model(model_dir)
    del model.decoder.layers[0].mlp.linear_fc2  # a model whose layers lack a target
    for layer in model.decoder.layers[1:]:
        del layer.mlp.linear_fc2
    try:
        attach_lora(model, LoRAConfig(targets=["linear_fc2"]), seed=0)
    except ValueError as err:
        messages["no_match"] = str(err)
    provider, model = load_hf_model(model_dir)
    attach_lora(model, LORA, seed=0)
    try:  # a PEFT adapter with an A per projection does not fit the fused layers' shared A
        load_peft_adapter(model, provider, LORA, model_dir.parent / "adapter_canonical")
    except ValueError as err:
        messages["unshared_into_fused"] = str(err)
    _, moe = load_hf_model(model_dir.parent / "moe")  # Qwen3-MoE: layer 0 dense, layers 1-2 MoE
    try:
        attach_lora(moe, LoRAConfig(), seed=0)
    except ValueError as err:
        messages["moe_mlp_targets"] = str(err)
    _, moe = load_hf_model(model_dir.parent / "moe")
    messages["moe_attention_adapters"] = attach_lora(moe, LoRAConfig(targets=["linear_qkv", "linear_proj"]), seed=0)
    return messages


def replicated_grads_agree(model) -> bool:
    """Whether every TP-replicated factor (A of column layers, B of row layers) has the same gradient on
    every TP rank (each rank computes it whole)."""
    from megatron.core import parallel_state as ps

    group, size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    agree = True
    for adapter in adapters_of(model):
        grad = (adapter.A if adapter.kind == "column" else adapter.B).grad
        copies = [torch.empty_like(grad) for _ in range(size)]
        dist.all_gather(copies, grad.contiguous(), group=group)
        agree &= all(torch.equal(c, copies[0]) for c in copies)
    return agree


def main() -> None:
    tp, pp = int(sys.argv[1]), int(sys.argv[2])
    model_dir, adapter_dir, out = Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5])
    options = (sys.argv[6] if len(sys.argv) > 6 else "").split(",")
    load_from = next((o.removeprefix("load=") for o in options if o.startswith("load=")), None)
    init_parallel(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    from megatron.core import parallel_state as ps

    from model_providers.hf_checkpoint import export_hf_checkpoint, iter_hf_weights, load_hf_model
    from model_providers.peft_adapter import export_peft_adapter, load_peft_adapter
    from parallel.lora import attach_lora

    from megarlhf.checkpoint.distributed import load_checkpoint, save_checkpoint

    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    provider, model = load_hf_model(model_dir, **(recompute if "recompute" in options else {}))
    model.config.variable_seq_lengths = True
    lora = LoRAConfig(rank=LORA.rank, alpha=LORA.alpha, canonical="canonical" in options)
    count = attach_lora(model, lora, seed=0)
    source = load_file(str(model_dir / "model.safetensors"))  # a fresh adapter (B = 0) merges to W exactly
    fresh_merged_equal = all(torch.equal(t, source[n]) for n, t in iter_hf_weights(model, provider))
    if load_from is not None:
        load_checkpoint(load_from, model)
    else:
        load_peft_adapter(model, provider, lora, adapter_dir)
    if "save" in options:
        save_checkpoint(out / "ckpt", model)
    vocab = provider.hf_config.vocab_size
    ids, pos, weights = inputs(vocab)
    with adapters_disabled(model):
        base_logits = run(model, ids, pos, weights, vocab, backward=False)
    logits = run(model, ids, pos, weights, vocab, backward=True)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    frozen_have_no_grad = all(p.grad is None for p in model.parameters() if not p.requires_grad)
    agree = replicated_grads_agree(model)
    grads = gradients_as_peft(model, provider, lora)
    export_peft_adapter(model, provider, lora, out / "adapter", base_model=str(model_dir))
    export_hf_checkpoint(model, provider, out / "merged", source_dir=model_dir)
    rank = dist.get_rank()
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        torch.save({"logits": logits, "base_logits": base_logits}, out / "logits.pt")
    if rank == 0:
        save_file(grads, str(out / "grads.safetensors"))
        info = {"adapters": count, "fresh_merged_equal": fresh_merged_equal, "trainable": trainable,
                "frozen_have_no_grad": frozen_have_no_grad, "replicated_grads_agree": agree,
                "adapter_params": sum(p.numel() for a in adapters_of(model) for p in (a.A, a.B))}
        if tp == 1 and pp == 1:
            info["errors"] = error_messages(model_dir)
        (out / "info.json").write_text(json.dumps(info))
    dist.barrier()


if __name__ == "__main__":
    main()
