"""Device-resident replacements for Megatron-Core's pure-torch fallbacks of the fused multi-tensor kernels.

Where neither Transformer Engine nor apex is installed (CPU, and a GPU without them), Megatron's gradient
clipping computes the gradient norm with ``megatron.core.utils.local_multi_tensor_l2_norm``, which builds
``torch.tensor([...])`` from one 0-dim norm per parameter: a device-to-host read for every parameter of
every optimizer step, each one draining a GPU's queue. :func:`l2_norm` computes the same norm of the
per-tensor norms with the norms stacked on the device (the same fp32 arithmetic in the same order), so the
step reads the device once, where Megatron takes the final norm.

:func:`install` (idempotent, called by :func:`parallel.runtime.init_parallel`) replaces
``megatron.core.optimizer.clip_grads.l2_norm_impl`` only when it is that fallback; TE's and apex's fused
kernels are left alone. This module patches nothing else.
"""
from __future__ import annotations

import torch


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``multi_tensor_l2norm``'s contract: (the l2 norm of every tensor of ``tensor_lists`` as a [1] fp32
    tensor on their device, None)."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    norms = torch.stack([torch.norm(t).float() for t in tensors])
    return torch.norm(norms).reshape(1), None


def install() -> bool:
    """Swaps Megatron's host-reading fallback l2 norm for :func:`l2_norm`; returns whether it did."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
    return clip_grads.l2_norm_impl is l2_norm
