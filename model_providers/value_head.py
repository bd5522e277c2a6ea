"""The value-head variant of a provider's GPTModel: one scalar per token (critic, reward model).

The body is the same GPTModel as the causal LM; only the last stage's ``output_layer`` is replaced by
:class:`ValueHead`, a replicated ``hidden -> 1`` projection, so the model's forward returns values of shape
[batch, seq, 1] instead of vocab logits. On the HF side this is ``...ForSequenceClassification`` with
``num_labels=1``: its ``score.weight`` is the value head, and its per-token scores (before it pools the
last non-pad token) are exactly these values.

Initialisation: from a ``...ForSequenceClassification`` checkpoint the head is loaded from
``score.weight``; from a causal LM the body is loaded and the head is freshly initialised
(normal(0, initializer_range), identical on every TP rank).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from model_providers.base import ModelProvider
from model_providers.hf_checkpoint import HFCheckpoint, export_hf_checkpoint, load_hf_weights

VALUE_HEAD_PARAM = "output_layer.weight"
HF_SCORE = "score.weight"


class ValueHead(MegatronModule):
    """``hidden -> 1``, replicated over TP ranks; called like GPTModel's output layer."""

    def __init__(self, config):
        super().__init__(config)
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        config.init_method(self.weight)

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return F.linear(hidden_states, self.weight), None


def build_value_model(provider: ModelProvider, params_dtype: torch.dtype = torch.float32, **config_overrides):
    """This rank's stage of the provider's GPTModel with a value head (never tied to the embedding)."""
    from parallel.runtime import model_groups

    model = provider.build_model(params_dtype, tie_embeddings=False, **config_overrides)
    if model.post_process:
        model.output_layer = ValueHead(model.config).to(model.decoder.final_layernorm.weight.device)
        tp = model_groups().tp
        if tp.size > 1:
            # Replicated parameter: every TP rank must start from the same draw (TP rank 0's).
            with torch.no_grad():
                dist.broadcast(model.output_layer.weight, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return model


def load_value_model(hf_dir: str | Path, params_dtype: torch.dtype = torch.float32, **config_overrides):
    """Builds a value model from an HF causal LM (fresh head) or ``...ForSequenceClassification`` (its
    ``score.weight``). Returns ``(provider, model)``."""
    from model_providers import get_provider

    provider = get_provider(hf_dir)
    model = build_value_model(provider, params_dtype, **config_overrides)
    if HF_SCORE in HFCheckpoint(hf_dir):
        load_hf_weights(model, provider, hf_dir, head="value")
    else:
        load_hf_weights(model, provider, hf_dir, head="none", allow_unmapped={VALUE_HEAD_PARAM})
    return provider, model


def export_reward_model(model, provider: ModelProvider, out_dir: str | Path, **kwargs) -> Path:
    """Writes a value model as an HF ``...ForSequenceClassification`` directory (``score.weight`` head).

    Same keyword arguments as :func:`~model_providers.hf_checkpoint.export_hf_checkpoint`.
    """
    return export_hf_checkpoint(model, provider, out_dir, head="value", **kwargs)
