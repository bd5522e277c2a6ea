"""Fused ops. ``logprob_entropy`` is the entry point: token log-probs and entropies straight from
hidden states and the (vocab-parallel) output weight, never materialising tokens x vocab logits;
``topk_logprobs`` is a frozen teacher's: the top-k of each position's distribution and the sampled token's
log-prob, forward only (``topk_logprob``).

It dispatches to the Triton forward for bf16/fp16 CUDA tensors when Triton is importable and to the
chunked torch implementation otherwise (fp32 included: there cuBLAS's IEEE products beat Triton's, see
``triton_logprob``); both share one contract (see ``fused_logprob``'s docstring).
"""
from __future__ import annotations

import importlib.util

import torch

from megarlhf.ops.fused_logprob import LogprobOptions, fused_logprob_entropy
from megarlhf.ops.topk_logprob import topk_logprobs

_BACKENDS = ("auto", "torch", "triton")


def logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    mask: torch.Tensor | None = None, options: LogprobOptions = LogprobOptions()):
    """(logprobs [N] (or [N, K] for targets [N, K]), entropy [N] or None), fp32; see
    ``fused_logprob.fused_logprob_entropy``.

    ``options.backend`` picks the implementation ("triton" on CPU tensors works only under
    TRITON_INTERPRET=1); ``options.chunk_size`` is the vocab chunk of the torch op and of the Triton path's
    backward (the Triton forward tiles by its own block sizes).
    """
    backend = options.backend
    if backend not in _BACKENDS:
        raise ValueError(f"logprob_entropy: backend must be one of {_BACKENDS}, got {backend!r}")
    several_targets = targets.dim() == 2  # K log-probs per row (a distillation loss): the torch op's alone
    if backend == "auto":
        use_triton = (hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and not several_targets
                      and importlib.util.find_spec("triton") is not None)
        backend = "triton" if use_triton else "torch"
    if backend == "triton" and several_targets:
        raise ValueError("logprob_entropy: the triton backend takes one target per row ([N]); "
                         f"got targets of shape {tuple(targets.shape)}: use backend 'torch' or 'auto'")
    if backend == "triton":
        # imported lazily: Triton decides at import time whether kernels run interpreted
        from megarlhf.ops.triton_logprob import triton_logprob_entropy
        return triton_logprob_entropy(hidden, weight, targets, mask, options)
    return fused_logprob_entropy(hidden, weight, targets, mask, options)


__all__ = ["LogprobOptions", "logprob_entropy", "fused_logprob_entropy", "topk_logprobs"]
