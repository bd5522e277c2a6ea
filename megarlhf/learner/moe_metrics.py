"""What a mixture-of-experts model's router did in one optimizer step, as step metrics.

:class:`RouterStats` hooks every router of a model and counts, on the device, the tokens each expert is
routed per layer during the step's forwards; Megatron's MoE metrics tracker holds the per-layer auxiliary
loss values. :meth:`RouterStats.step_metrics` reduces both over data x context parallel ranks (different
tokens; under sequence parallelism the tensor-parallel ranks too) and pipeline stages (different layers) and
reads them with one host transfer:

* ``moe/imbalance``: max over experts / mean over experts of the tokens routed, averaged over MoE layers
  (1.0 is perfectly balanced; ``num_experts / top_k`` when every token goes to the same experts), and
  ``moe/imbalance_max`` (the worst layer), ``moe/layer<L>/imbalance`` per MoE layer (L from 0);
* ``moe/<load-balancing type's loss>`` and ``moe/z_loss`` where those losses are on: the values before their
  coefficient, averaged over MoE layers, micro-batches and data x context parallel ranks.
"""
from __future__ import annotations

import torch

# the name Megatron's metrics tracker records each load-balancing type's loss under
TRACKED_LOSS = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                "global_aux_loss": "global_load_balancing_loss"}


def stage_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(global layer index, router) of every MoE layer of this pipeline stage."""
    from model_providers.hf_checkpoint import unwrap

    layers = getattr(getattr(unwrap(model), "decoder", None), "layers", [])
    return [(layer.layer_number - 1, layer.mlp.router) for layer in layers if hasattr(layer.mlp, "router")]


class RouterStats:
    """Tokens routed to each expert per layer since the last :meth:`reset`, counted on the device."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int, device: torch.device,
                 tracked: tuple[str, ...] = (), sequence_parallel: bool = False):
        self.routers = stage_routers(model)
        self.sequence_parallel = sequence_parallel  # each TP rank routes its part of the tokens
        self.tracked = tracked  # the auxiliary losses Megatron records (the same names on every rank)
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.moe_layers = torch.zeros(num_layers, dtype=torch.float64, device=device)
        for index, router in self.routers:
            self.moe_layers[index] = 1.0
            router.register_forward_hook(self._counter(index), with_kwargs=True)

    @classmethod
    def attach(cls, model: torch.nn.Module, provider, device: torch.device) -> "RouterStats | None":
        """Stats for an MoE model (None for a dense one)."""
        if not provider.is_moe:
            return None
        from model_providers.hf_checkpoint import unwrap

        config = unwrap(model).config
        tracked = ((TRACKED_LOSS[config.moe_router_load_balancing_type],) if config.moe_aux_loss_coeff else ()) + \
            (("z_loss",) if config.moe_z_loss_coeff else ())
        return cls(model, provider.hf_config.num_hidden_layers, provider.num_experts, device, tracked,
                   bool(getattr(config, "sequence_parallel", False)))

    def _counter(self, index: int):
        def hook(module, args, kwargs, output):
            routing_map = output[1].detach()  # [tokens, experts] bool: the experts each token is sent to
            # True: a padding token (the expert-parallel padding micro-batches of megarlhf.learner.forward)
            padding = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
            if padding is not None:
                routing_map = routing_map & ~padding.reshape(-1, 1)
            self.counts[index] += routing_map.sum(0)
        return hook

    def reset(self) -> None:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        self.counts.zero_()
        get_moe_metrics_tracker().clear()

    def step_metrics(self, runtime, micro_batches: int) -> dict[str, float]:
        """The step's routing metrics (module docstring), identical on every rank."""
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        entries = get_moe_metrics_tracker().metrics
        layers = len(self.moe_layers)
        losses = [entries[name].values.to(self.counts)[:layers] if name in entries else self.counts.new_zeros(layers)
                  for name in self.tracked]  # a stage without MoE layers recorded none
        packed = torch.cat([self.counts.flatten(), *[v / max(micro_batches, 1) / runtime.dp_cp.size for v in losses]])
        runtime.all_reduce_on_device(packed, over="dp_cp")
        if self.sequence_parallel:  # the TP ranks counted different tokens (no router losses then: refused)
            runtime.all_reduce_on_device(packed, over="tp")
        moe = self.moe_layers.clone()
        if runtime.pp.size > 1:  # stages hold disjoint layers
            runtime.all_reduce_on_device(packed, over="pp")
            runtime.all_reduce_on_device(moe, op="max", over="pp")
        counts = packed[:self.counts.numel()].view_as(self.counts)
        imbalance = torch.where(moe > 0, counts.max(1).values / counts.mean(1).clamp_min(1e-12), 0.0)
        per_loss = packed[self.counts.numel():].view(len(self.tracked), layers)
        summary = torch.stack([imbalance.sum() / moe.sum(), imbalance.max(), *((per_loss * moe).sum(1) / moe.sum())])
        host = torch.cat([summary, imbalance, moe]).tolist()  # host: the one read of the routing metrics
        metrics = {"moe/imbalance": host[0], "moe/imbalance_max": host[1]}
        metrics.update({f"moe/{name}": host[2 + j] for j, name in enumerate(self.tracked)})
        per_layer, is_moe = host[len(summary):len(summary) + layers], host[len(summary) + layers:]
        metrics.update({f"moe/layer{i}/imbalance": value for i, (value, flag) in enumerate(zip(per_layer, is_moe))
                        if flag})
        return metrics


def mean_moe_metrics(prefix: str, per_step: list[dict[str, float]]) -> dict[str, float]:
    """The routing metrics of one or more optimizer steps (mean over steps), under ``prefix``; {} without
    any (a dense model, or steps that ran no forward)."""
    per_step = [metrics for metrics in per_step if metrics]
    names = sorted({name for metrics in per_step for name in metrics})
    return {f"{prefix}/{name}": sum(m.get(name, 0.0) for m in per_step) / len(per_step) for name in names}
