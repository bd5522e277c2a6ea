"""The ``model`` section: which checkpoint, its dtype, LoRA adapters and MoE router losses."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarlhf.core.dtypes import check_dtype_name

# the Megatron linear layers LoRA can adapt (parallel.lora knows how each is split over TP ranks)
LORA_TARGETS = ("linear_qkv", "linear_fc1", "linear_proj", "linear_fc2")


@dataclass
class LoRAConfig:
    """``model.lora``: low-rank adapters on the targeted linear layers; everything else is frozen."""

    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, as PEFT's lora_dropout
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # Megatron layer names
    # one adapter per HF projection of a fused layer (q, k, v of linear_qkv; gate, up of linear_fc1), as PEFT
    # holds them: any PEFT adapter loads and exports exactly. False: the fused layer's projections share one
    # A (fewer parameters; a PEFT adapter loads only if its q/k/v, gate/up A factors are equal)
    canonical: bool = False
    # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) the actor's adapters start
    # from; its rank, alpha and target projections must be these (None: fresh adapters, B = 0)
    adapter_path: str | None = None

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be an int >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoRAConfig.targets: {unknown or 'an empty list'} "
                             f"{'name no layer kind LoRA supports' if unknown else 'targets nothing'}; "
                             f"known: {', '.join(LORA_TARGETS)}")
        if not isinstance(self.canonical, bool):
            raise ValueError(f"LoRAConfig.canonical must be true or false, got {self.canonical!r}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRAConfig.targets lists a layer twice: {self.targets}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss")


@dataclass
class MoEConfig:
    """``model.moe``: router training signals of a mixture-of-experts model (refused for a dense one)."""

    aux_loss_coeff: float = 0.0  # weight of the load-balancing loss (0: off)
    # per micro-batch, per row of the micro-batch (with packing, one row holds many sequences: then the same
    # as per micro-batch), or over all data-parallel ranks' tokens
    load_balancing: Literal[LOAD_BALANCING] = "aux_loss"
    z_loss_coeff: float = 0.0  # weight of the router z-loss (0: off)

    def __post_init__(self):
        if not (self.aux_loss_coeff >= 0 and self.z_loss_coeff >= 0):
            raise ValueError(f"MoEConfig.aux_loss_coeff and z_loss_coeff must be >= 0, got {self.aux_loss_coeff}, "
                             f"{self.z_loss_coeff}")
        if self.load_balancing not in LOAD_BALANCING:
            raise ValueError(f"MoEConfig.load_balancing must be one of {LOAD_BALANCING}, got {self.load_balancing!r}")

    @property
    def enabled(self) -> bool:
        return self.aux_loss_coeff > 0 or self.z_loss_coeff > 0

    def transformer_config_fields(self) -> dict:
        """Megatron's fields for these settings; empty when both losses are off (the provider's defaults)."""
        if not self.enabled:
            return {}
        return dict(moe_aux_loss_coeff=self.aux_loss_coeff, moe_z_loss_coeff=self.z_loss_coeff or None,
                    moe_router_load_balancing_type=self.load_balancing if self.aux_loss_coeff else "none")


@dataclass
class ModelConfig:
    path: str  # HF model directory (the actor, and the reference model)
    dtype: str = "bfloat16"  # the trainer's parameter dtype (megarlhf.core.dtypes: float32, bfloat16)
    critic_path: str | None = None  # HF directory the critic starts from (None: the actor's path)
    # LoRA adapters on the actor and critic (parallel.lora); the base weights are frozen, and the
    # reference policy is the base model with adapters off (None: train all weights)
    lora: LoRAConfig | None = None
    # router training signals of a mixture-of-experts model (load-balancing and z-loss; off by default)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self):
        check_dtype_name(self.dtype, "ModelConfig.dtype")
