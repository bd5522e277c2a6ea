"""Sequence parallelism with Megatron's local (non-Transformer-Engine) layer spec.

Under sequence parallelism (``TransformerConfig.sequence_parallel``, which megarlhf turns on for
mixture-of-experts models at TP > 1: :meth:`model_providers.moe.MoEProvider.moe_config_fields`) the
activations between the tensor-parallel regions are split along the sequence over the TP ranks. A norm then
sees 1 / TP of the tokens, so its weight's gradient is a partial sum that Megatron's ``finalize_model_grads``
adds up over the TP ranks for every parameter marked ``sequence_parallel``. Transformer Engine's norms are
marked; the local spec's ``WrappedTorchNorm`` (torch's RMSNorm / LayerNorm, used where neither TE nor apex
is installed, e.g. CPU and the GPU check's machine) refuses sequence parallelism instead.
:class:`SequenceParallelTorchNorm` is that norm with its weight marked, and
:func:`with_sequence_parallel_norms` puts it into a spec.

Megatron's other replicated parameters that see split activations (routers, Qwen2-MoE's shared-expert
gate) mark themselves.
"""
from __future__ import annotations

from typing import Any

import torch

from parallel.spec_tree import replace_in_spec


class SequenceParallelTorchNorm:
    """torch's ``RMSNorm`` / ``LayerNorm`` as Megatron's ``WrappedTorchNorm`` builds it, with its parameters
    marked ``sequence_parallel`` when the config is (module docstring)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(f"SequenceParallelTorchNorm: normalization {config.normalization!r} is not one of "
                             f"{sorted(kinds)}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_sequence_parallel_norms(spec: Any) -> Any:
    """``spec`` (a local layer or block spec) with its torch norms able to run sequence-parallel."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    swapped, _ = replace_in_spec(spec, lambda field, value: SequenceParallelTorchNorm if value is WrappedTorchNorm
                                 else None)
    return swapped
