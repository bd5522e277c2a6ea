"""Rank script for the SmolLM2-135M-Instruct parity tests (test_smollm2.py), one launch per layout and dtype.
Usage: _worker_smollm2.py TP PP DTYPE MODEL_DIR OUT_DIR   (DTYPE: float32 or bfloat16)

Loads the real pretrained HF checkpoint into the sharded Megatron model at that layout and dtype, runs a
forward on two sequences of real English text (the model's own tokenizer), gathers the full-vocabulary
logits on the last pipeline stage and compares them with HF transformers' logits computed in fp32:
max / mean |delta| of the logits and of their log_softmax, top-1 agreement, and HF's own next-token loss
on the text (a sanity check that the model and tokenizer are the real ones, so parity is not trivially
met by, say, a model that outputs near-constant logits).

At TP=1, PP=1 in float32 it also records the HF -> Megatron -> HF round trip of every tensor (via
``iter_hf_weights``, bitwise against the safetensors file) and an ``export_hf_checkpoint`` directory
reloaded by transformers, every tensor compared bitwise with the source model.

A layout the model's head counts cannot be split into is expected to be refused while loading; the
refusal's message is recorded instead (``refused``).
"""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The tiny-model parity worker's forward (plain call or Megatron's pipeline schedule), TP logit gather
# and iter_hf_weights round trip work unchanged on the real model.
from _worker_parity import forward, gather_logits, round_trip
from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

SEQ = 256
# Varied, ordinary English; the two sequences walk it in different orders so they differ everywhere.
SENTENCES = (
    "The morning train to the coast was late again, so most passengers bought coffee and waited.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen inside green leaves.",
    "She practised the piano for an hour every evening until the difficult passage finally felt easy.",
    "A good recipe for bread needs only flour, water, salt, yeast and a little patience.",
    "The committee postponed its decision because several members wanted to read the report first.",
    "In the winter the lake freezes solid and children from the village skate on it after school.",
    "Prime numbers have exactly two divisors: one and the number itself, like seven or thirteen.",
    "The old library downtown keeps its rare maps in a cool room with very low light.",
    "When the storm passed, the farmers walked the fields to count the damaged rows of corn.",
    "Learning a second language is easier when you listen to it every day, even for ten minutes.",
    "The museum's new exhibition explains how ancient sailors navigated using only the stars.",
    "He fixed the bicycle chain with a borrowed tool and rode the last twenty miles home.",
)


def text_inputs(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of exactly SEQ real tokens (no padding, so no attention mask is needed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for order in (SENTENCES, SENTENCES[::-1][1::2] + SENTENCES[::-1][0::2]):
        text, ids = "", []
        while len(ids) < SEQ:
            text += " ".join(order) + " "
            ids = tok(text.strip()).input_ids
        rows.append(ids[:SEQ])
    ids = torch.tensor(rows, dtype=torch.long)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(len(rows), -1)


def compare(got: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> dict:
    """Megatron's logits (any dtype) vs HF's fp32 logits, and HF's next-token loss on the text."""
    got = got.float()
    diff = (got - ref).abs()
    lp_diff = (F.log_softmax(got, dim=-1) - F.log_softmax(ref, dim=-1)).abs()
    nll = F.cross_entropy(ref[:, :-1].reshape(-1, ref.shape[-1]), ids[:, 1:].reshape(-1))
    return {"logits_shape": list(got.shape),
            "logits_max": diff.max().item(), "logits_mean": diff.mean().item(),
            "logprob_max": lp_diff.max().item(), "logprob_mean": lp_diff.mean().item(),
            "top1_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "ref_abs_max": ref.abs().max().item(), "hf_nll": nll.item()}


def check_export(model, provider, source: Path, ref_model, out: Path) -> dict:
    """export_hf_checkpoint (sharded, so the index path is exercised too) reloaded by transformers; every
    tensor of its state dict bitwise equal to the source model's. Collective; rank 0 compares."""
    from transformers import AutoModelForCausalLM

    from model_providers.hf_checkpoint import export_hf_checkpoint

    export_hf_checkpoint(model, provider, out, source_dir=source, max_shard_bytes=200 * 2**20)
    result = {"files": sorted(p.name for p in out.iterdir())}
    if dist.get_rank() == 0:
        exported = AutoModelForCausalLM.from_pretrained(out).eval()
        ref_sd, exp_sd = ref_model.state_dict(), exported.state_dict()
        result["dtypes"] = sorted({str(t.dtype) for t in exp_sd.values()})
        result["keys_equal"] = sorted(ref_sd) == sorted(exp_sd)
        result["not_equal"] = sorted(k for k in ref_sd if k in exp_sd and not torch.equal(ref_sd[k], exp_sd[k]))
        result["num_tensors"] = len(exp_sd)
        # Tied embeddings must come back tied, not as a separate lm_head copy that merely equals it.
        result["tied"] = exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    return result


def main(tp: int, pp: int, dtype_name: str, model_dir: Path, out_dir: Path, first: int = 0, last: int = 0) -> None:
    from megatron.core import parallel_state as ps

    from model_providers.hf_checkpoint import load_hf_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    layout = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            num_layers_in_first_pipeline_stage=first or None, num_layers_in_last_pipeline_stage=last or None)
    launch = init_parallel(layout, seed=3).launch
    try:
        provider, model = load_hf_model(model_dir, params_dtype=dtype)
    except ValueError as err:  # e.g. a TP size that does not divide the head counts
        write_rank_result(out_dir, launch.rank, {"refused": f"{type(err).__name__}: {err}"})
        return
    result = {"last_stage": ps.is_pipeline_last_stage(), "tp_rank": ps.get_tensor_model_parallel_rank(),
              "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
              "padded_vocab": provider.padded_vocab_size(tp),
              "layer_numbers": [layer.layer_number for layer in model.decoder.layers]}
    ids, pos = text_inputs(model_dir)
    result["tokens"] = list(ids.shape)
    logits = forward(model, ids, pos)
    ref_model = None
    if logits is not None:
        full = gather_logits(logits)  # collective over the TP group: every last-stage rank joins
        del logits
        if ps.get_tensor_model_parallel_rank() == 0:  # one fp32 HF reference per launch is enough
            from transformers import AutoModelForCausalLM

            ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                ref = ref_model(input_ids=ids).logits
            vocab = provider.hf_config.vocab_size
            result.update(compare(full[..., :vocab], ref, ids))
            result["padded_logits_abs_max"] = full[..., vocab:].abs().max().item() if full.shape[-1] > vocab else 0.0
            del ref
        del full
    gc.collect()
    if tp == 1 and pp == 1 and dtype == torch.float32:
        result["round_trip"] = round_trip(model, provider, model_dir)
        gc.collect()
        result["export"] = check_export(model, provider, model_dir, ref_model, out_dir / "export")
    write_rank_result(out_dir, launch.rank, result)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]), *map(int, sys.argv[6:]))
