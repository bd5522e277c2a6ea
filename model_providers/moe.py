"""What every mixture-of-experts architecture (Qwen3-MoE, Qwen2-MoE, Mixtral) shares on top of the dense
provider: the routing translated to Megatron's router, which layers are MoE, the expert-parallel checks, the
expert weight-table entries, and the HF checkpoint layout of the experts.

Routing: HF's routers take a softmax over all experts' logits, keep the top k and, when ``norm_topk_prob``
(always in Mixtral), renormalise the k kept weights to sum to 1. Megatron's ``TopKRouter`` with the softmax
score function gives the renormalised weights with ``moe_router_pre_softmax=False`` (a softmax over the k
kept logits is the same thing) and the plain ones with ``pre_softmax=True``. The router runs in fp32
(``moe_router_dtype``), as HF's softmax does. Routers HF models of other families use (group-limited
top-k, a per-expert score-correction bias, sigmoid scores, a routed scaling factor, input jitter) have no
counterpart here and are refused by name, as is anything a config sets that would change the routing.

Experts are dropless (no capacity factor), so every token reaches its k experts exactly as in HF.
Expert weights are stored per expert in HF checkpoints (``...mlp.experts.{e}.gate_proj.weight``;
transformers 5 fuses them in memory but reads and writes that layout); Megatron's ``SequentialMLP``
holds this rank's ``num_experts / EP`` experts as ``mlp.experts.local_experts.{i}``, global expert
``ep_rank * num_experts / EP + i``. A table entry whose Megatron name has ``{expert}`` is one such
per-expert tensor (:mod:`model_providers.hf_checkpoint` expands it over the local experts and gathers
it over the expert-parallel group on export).

:class:`MoEConfig` (``model.moe``) holds the router's training signals, Megatron's own: the load-balancing
auxiliary loss (``aux_loss_coeff``, of type ``load_balancing``) and the router z-loss (``z_loss_coeff``),
both off by default. Megatron adds their gradients inside the forward (``MoEAuxLossAutoScaler``), averaged
over the step's micro-batches and DDP's ranks; they are not part of a trainer's reported loss
(:mod:`megarlhf.learner.moe_metrics` reports them).
"""
from __future__ import annotations

from typing import ClassVar

from model_providers.base import ModelProvider
from model_providers.llama import LAYER, MEGATRON_LAYER
from model_providers.mapping import GATED_MLP, REPLICATED, ROW, WeightMapping
from megarlhf.config.parallel import LayoutError, ParallelConfig

EXPERT = MEGATRON_LAYER + "mlp.experts.local_experts.{expert}."

# HF config fields of routers this translation cannot reproduce, with the value that means "not used".
UNSUPPORTED_ROUTING = {
    "n_group": (None, 1), "topk_group": (None, 1), "topk_method": (None, "greedy"),
    "scoring_func": (None, "softmax"), "routed_scaling_factor": (None, 1.0), "router_jitter_noise": (None, 0.0),
}


def expert_mappings(hf_expert: str, gate: str, up: str, down: str) -> tuple[WeightMapping, ...]:
    """The routed experts of one MoE layer: HF ``<hf_expert>{expert}.<gate|up|down>.weight`` <-> Megatron's
    local expert fc1 ([gate; up] per expert-TP rank) and fc2."""
    return (
        WeightMapping(EXPERT + "linear_fc1.weight", (hf_expert + gate + ".weight", hf_expert + up + ".weight"),
                      GATED_MLP),
        WeightMapping(EXPERT + "linear_fc2.weight", (hf_expert + down + ".weight",), ROW),
    )


def router_mapping(hf_router: str) -> WeightMapping:
    return WeightMapping(MEGATRON_LAYER + "mlp.router.weight", (LAYER + hf_router,), REPLICATED)


SHARED_EXPERT_MAPPINGS = (
    WeightMapping(MEGATRON_LAYER + "mlp.shared_experts.linear_fc1.weight",
                  (LAYER + "mlp.shared_expert.gate_proj.weight", LAYER + "mlp.shared_expert.up_proj.weight"),
                  GATED_MLP),
    WeightMapping(MEGATRON_LAYER + "mlp.shared_experts.linear_fc2.weight", (LAYER + "mlp.shared_expert.down_proj.weight",),
                  ROW),
    WeightMapping(MEGATRON_LAYER + "mlp.shared_experts.gate_weight", (LAYER + "mlp.shared_expert_gate.weight",),
                  REPLICATED),
)


class MoEProvider(ModelProvider):
    """A dense provider's attention and norms plus routed experts. Subclasses name the config fields."""

    is_moe = True
    num_experts_field: ClassVar[str] = "num_experts"  # Mixtral: "num_local_experts"
    expert_ffn_field: ClassVar[str] = "moe_intermediate_size"  # Mixtral: "intermediate_size"
    always_normalised: ClassVar[bool] = False  # Mixtral renormalises the top-k weights whatever the config

    # ---- what the config says -------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return int(getattr(self.hf_config, self.num_experts_field))

    @property
    def top_k(self) -> int:
        return int(self.hf_config.num_experts_per_tok)

    @property
    def normalises_top_k(self) -> bool:
        return self.always_normalised or bool(getattr(self.hf_config, "norm_topk_prob", False))

    @property
    def shared_expert_size(self) -> int:
        return int(getattr(self.hf_config, "shared_expert_intermediate_size", 0) or 0)

    def moe_layer_pattern(self) -> list[int]:
        """1 for each MoE layer, 0 for each dense one (HF ``mlp_only_layers`` and ``decoder_sparse_step``)."""
        c = self.hf_config
        dense = set(getattr(c, "mlp_only_layers", None) or [])
        step = int(getattr(c, "decoder_sparse_step", 1) or 1)
        return [0 if i in dense or (i + 1) % step else 1 for i in range(c.num_hidden_layers)]

    def check_supported(self) -> None:
        super().check_supported()
        c = self.hf_config
        for field, unused in UNSUPPORTED_ROUTING.items():
            value = getattr(c, field, None)
            if value not in unused:
                raise self._unsupported(f"router setting {field}={value!r} (supported routing: softmax top-k, "
                                        f"optionally renormalised)")
        if not 1 <= self.top_k <= self.num_experts:
            raise self._unsupported(f"num_experts_per_tok={self.top_k} with {self.num_experts} experts")
        if not any(self.moe_layer_pattern()):
            raise self._unsupported("an MoE config whose layers are all dense (mlp_only_layers / decoder_sparse_step)")

    # ---- Megatron pieces ------------------------------------------------------------------------
    def check_parallel(self, parallel: ParallelConfig) -> None:
        super().check_parallel(parallel)
        ep, tp = parallel.expert_model_parallel_size, parallel.tensor_model_parallel_size
        if self.num_experts % ep:
            raise LayoutError(f"expert_model_parallel_size={ep} does not divide num_experts={self.num_experts} of "
                              f"this {self.model_type} model")
        for field in (self.expert_ffn_field, "shared_expert_intermediate_size"):
            size = int(getattr(self.hf_config, field, 0) or 0)
            if size % tp:
                raise LayoutError(f"tensor_model_parallel_size={tp} (the expert tensor-parallel size) does not divide "
                                  f"{field}={size} of this {self.model_type} model")

    def dense_only_stages(self, parallel: ParallelConfig) -> list[int]:
        """The pipeline stages of ``parallel`` that would hold no MoE layer. A trained model refuses them:
        Megatron builds no expert optimizer there, while the other stages reduce their expert gradient
        norms over groups that span it."""
        pattern, start, stages = self.moe_layer_pattern(), 0, []
        for stage, count in enumerate(parallel.stage_layers(self.hf_config.num_hidden_layers)):
            if not any(pattern[start:start + count]):
                stages.append(stage)
            start += count
        return stages

    def moe_config_fields(self, parallel: ParallelConfig) -> dict:
        """The TransformerConfig fields of the routed (and shared) experts. Under tensor parallelism the model
        runs with sequence parallelism: Megatron's MoE layer needs it to train (without it every TP rank
        would dispatch the same tokens and the experts' gradients would count TP times), and a frozen copy
        uses it too, so that every model of a run takes the same micro-batches."""
        fields = dict(num_moe_experts=self.num_experts, moe_router_topk=self.top_k,
                      sequence_parallel=parallel.tensor_model_parallel_size > 1,
                      moe_ffn_hidden_size=int(getattr(self.hf_config, self.expert_ffn_field)),
                      moe_layer_freq=self.moe_layer_pattern(), moe_router_score_function="softmax",
                      moe_router_pre_softmax=not self.normalises_top_k, moe_router_dtype="fp32",
                      moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                      moe_aux_loss_coeff=0.0, moe_grouped_gemm=False)
        if self.shared_expert_size:
            fields.update(moe_shared_expert_intermediate_size=self.shared_expert_size, moe_shared_expert_gate=True)
        return fields
