"""Replacements for three pieces of Megatron-Core that make the host wait for the device on every call.

All are installed on every device by :func:`install` (idempotent, called by
:func:`parallel.runtime.init_distributed`); each computes the same numbers as the code it replaces.

1. **Gradient norm.** Where neither Transformer Engine nor apex is installed (CPU, and a GPU without them),
   Megatron's gradient clipping uses ``megatron.core.utils.local_multi_tensor_l2_norm``, which builds
   ``torch.tensor([...])`` from one 0-dim norm per parameter: a device-to-host read for every parameter of
   every optimizer step, each draining a GPU's queue. :func:`l2_norm` stacks the per-tensor norms on the
   device (the same fp32 arithmetic in the same order). Replaced only when Megatron chose that fallback;
   TE's and apex's fused kernels are left alone.
2. **RoPE on packed (``thd``) rows** without the fused kernel (``apply_rope_fusion=False``, Megatron's
   default): ``rope_utils._apply_rotary_pos_emb_thd`` reads ``cu_seqlens`` back and loops over the packed
   sequences in Python, twice per layer, and with a per-token table (Megatron's "packed freqs") reads each
   sequence's offset with ``.item()``. :func:`_rope_thd_vectorised` applies Megatron's own bshd formula once
   to the whole packed tensor (bitwise equal): a per-token table, which every packed row at context
   parallel size 1 carries (:class:`model_providers.gpt_model.TokenPositionGPTModel`), is applied as is with
   no device read; a per-sequence table is gathered per token by its position within its sequence. On CPU
   it is also 5.5x faster on 64 packed sequences (``bench/bench_rope_thd.py``). Calls under context
   parallelism (CP > 1) go to Megatron's function unchanged.
3. **The vocab-parallel embedding at TP > 1** masks the token ids outside this rank's vocabulary shard,
   and then their embeddings, by boolean-mask assignment (``x[mask] = 0``): two index-by-mask ops per
   forward of every micro-batch, each a ``nonzero`` that waits for the device.
   :func:`_embedding_without_mask_indexing` does the same with ``torch.where`` / ``masked_fill``. Megatron's
   other variants (deterministic mode, GTP rematerialisation, reduce-scattered embeddings) keep its code.
"""
from __future__ import annotations

import torch


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``multi_tensor_l2norm``'s contract: (the l2 norm of every tensor of ``tensor_lists`` as a [1] fp32
    tensor on their device, None)."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    norms = torch.stack([torch.norm(t).float() for t in tensors])
    return torch.norm(norms).reshape(1), None


def _rope_thd_vectorised(original):
    """Megatron's ``_apply_rotary_pos_emb_thd`` without the per-sequence loop (CP = 1)."""
    from megatron.core.models.common.embeddings import rope_utils

    def apply(t, cu_seqlens, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
              cp_group=None, multi_latent_attention=None):
        def megatrons():
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale, cp_group=cp_group,
                            multi_latent_attention=multi_latent_attention)

        if cp_group is None or cp_group.size() != 1 or multi_latent_attention is not None:
            return megatrons()
        total = t.size(0)
        if freqs.size(0) == total:  # Megatron's "packed freqs": already one row per token (no device read)
            per_token = freqs
        elif int(cu_seqlens[-1].item()) != total:
            return megatrons()
        else:
            starts = cu_seqlens[:-1].long()
            lengths = cu_seqlens[1:].long() - starts
            offsets = torch.repeat_interleave(starts, lengths, output_size=total)
            per_token = freqs[torch.arange(total, device=t.device) - offsets]
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), per_token, rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale).squeeze(1)

    apply.__wrapped__ = original
    return apply


def _embedding_without_mask_indexing(original):
    """``VocabParallelEmbedding.forward`` at TP > 1 with the out-of-shard masking done without boolean-mask
    indexing (module docstring, 3); anything else goes to ``original``."""
    import functools

    import torch.nn.functional as F

    @functools.wraps(original)
    def forward(self, input_):
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        if (self.tp_group.size() == 1 or self.deterministic_mode or getattr(self, "gtp_remat_size", 1) > 1
                or self.reduce_scatter_embeddings):
            return original(self, input_)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        masked_input = torch.where(outside, 0, input_ - self.vocab_start_index)
        output_parallel = F.embedding(masked_input, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    return forward


def install() -> dict[str, bool]:
    """Applies the replacements (once); returns which of them are in place."""
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
    if not hasattr(rope_utils._apply_rotary_pos_emb_thd, "__wrapped__"):
        rope_utils._apply_rotary_pos_emb_thd = _rope_thd_vectorised(rope_utils._apply_rotary_pos_emb_thd)
    if not hasattr(VocabParallelEmbedding.forward, "__wrapped__"):
        VocabParallelEmbedding.forward = _embedding_without_mask_indexing(VocabParallelEmbedding.forward)
    return {"l2_norm": clip_grads.l2_norm_impl is l2_norm,
            "rope_thd": hasattr(rope_utils._apply_rotary_pos_emb_thd, "__wrapped__"),
            "embedding": hasattr(VocabParallelEmbedding.forward, "__wrapped__")}
