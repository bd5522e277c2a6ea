"""LoRA adapters on Megatron-Core's linear layers, tensor-parallel aware.

An adapter adds ``scale * B @ A @ dropout(x)`` (``scale = alpha / rank``, A: ``rank x in``, B:
``out x rank``) to the output of a frozen linear layer, as PEFT's LoRA does. ``attach_lora`` puts one
on every targeted layer of this rank's pipeline stage and freezes everything else, so only adapters
(and the parameters a caller names, e.g. a critic's value head) reach DDP's buffers and the optimizer.

Tensor parallelism. The factors are split so that each rank computes exactly the gradient of its own
shard and nothing outside the adapter changes:

* column-parallel layers (``linear_qkv``, ``linear_fc1``: weight ``[out/tp, in]``, input replicated):
  A ``[r, in]`` replicated, B ``[out/tp, r]`` sharded like the weight (for ``linear_fc1`` in Megatron's
  per-rank ``[gate; up]`` order). The rank-r activation's gradient is summed over TP ranks
  (``copy_to_tensor_model_parallel_region``), as the base layer does for its input.
* row-parallel layers (``linear_proj``, ``linear_fc2``: weight ``[out, in/tp]``, input sharded): A
  ``[r, in/tp]`` sharded like the weight, B ``[out, r]`` replicated; the rank-r activation is summed
  over TP ranks (``reduce_from_tensor_model_parallel_region``) before B.

Sharded factors carry Megatron's tensor-parallel attributes, so the gradient norm counts replicated
factors once. A is initialised as PEFT does (Kaiming-uniform, bound ``1/sqrt(in)``) from a generator
seeded by the run seed and the layer's *global* name, drawn at full size and then sliced: the same
adapters at every TP/PP layout. B starts at zero, so a fresh adapter leaves the model unchanged.

Canonical layout (``model.lora.canonical``). By default a fused column-parallel layer holds one adapter,
so q, k and v (gate and up) share one A: fewer parameters, but a PEFT adapter trained elsewhere, with an A
per projection, cannot be loaded exactly. :class:`CanonicalAdapter` holds one adapter per HF projection,
as PEFT does, and lays their updates out in the fused layer's row order (per query group ``[q; k; v]``,
or ``[gate; up]``): any PEFT adapter of those projections loads and exports exactly.

Placement. An adapter is a sibling of its layer (``self_attention.linear_qkv`` ->
``self_attention.linear_qkv_lora``, called from a forward hook on the layer), not a child: Megatron's
linear layers build their checkpoint entries from their whole state dict with a fixed axis map, while a
sibling is asked for its own (:meth:`LoRAAdapter.sharded_state_dict`), so distributed checkpoints save,
resume and reshard adapters like any other parameter. The base parameters keep their names, so the HF
mapping tables, loaders and checkpoints of the dense model apply unchanged.

:func:`merged_weight` gives the shard ``W + scale * B @ A`` (computed in fp32, rounded once to W's
dtype; exactly W while B is zero) that weight sync and HF export send instead of W, and
:func:`adapters_disabled` turns every adapter off: the frozen base model is the reference policy, with
no second copy of its weights.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megarlhf.config.model import LoRAConfig

# Megatron submodule name -> how its weight is split over tensor-parallel ranks, and the block holding it
TARGET_KINDS = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row"}
TARGET_BLOCKS = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp",
                 "linear_fc2": "mlp"}
SUFFIX = "_lora"
# the HF projections a fused column-parallel layer holds, in its row order: one adapter each when canonical
CANONICAL_PARTS = {"linear_qkv": ("query", "key", "value"), "linear_fc1": ("gate", "up")}
# the Megatron layer classes whose parallel layout the adapters above are written for
_COLUMN_CLASSES = ("ColumnParallelLinear", "TEColumnParallelLinear")
_ROW_CLASSES = ("RowParallelLinear", "TERowParallelLinear")


class TPGroup(NamedTuple):
    """This rank's tensor-parallel group (Megatron's, a group object even at size 1)."""

    rank: int
    size: int
    group: object


class LoRAError(ValueError):
    """A LoRA setting that cannot apply to this model (named)."""


class LoRAAdapter(torch.nn.Module):
    """The A and B factors of one layer's adapter on this TP rank, and the hook that applies them."""

    def __init__(self, name: str, kind: str, shape: tuple[int, int], config: LoRAConfig, *, tp: TPGroup,
                 like: torch.Tensor, seed: int, gated: bool = False):
        """``shape``: the layer's full (out, in) features; ``tp``: this rank's tensor-parallel group; the
        factors take ``like``'s dtype and device (the layer's weight)."""
        super().__init__()
        out_features, in_features = shape
        tp_rank, tp_size, dtype, device = tp.rank, tp.size, like.dtype, like.device
        self.name, self.kind, self.gated = name, kind, gated
        self.scale, self.rank = config.scale, config.rank
        self.tp_group, self.tp_size = tp.group, tp_size
        self.dropout = config.dropout
        self.enabled = True
        bound = 1.0 / math.sqrt(in_features)  # PEFT's kaiming_uniform_(a=sqrt(5)) on [rank, in]
        generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full_a = torch.empty(config.rank, in_features).uniform_(-bound, bound, generator=generator)  # host: seeded init
        if kind == "row":
            per_rank = in_features // tp_size
            full_a = full_a[:, tp_rank * per_rank:(tp_rank + 1) * per_rank]
            b_rows = out_features
        else:
            b_rows = out_features // tp_size
        self.A = torch.nn.Parameter(full_a.to(device=device, dtype=dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(b_rows, config.rank, dtype=dtype, device=device))
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        sharded, dim = (self.B, 0) if kind == "column" else (self.A, 1)
        set_tensor_model_parallel_attributes(sharded, is_parallel=True, dim=dim, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update to add to the layer's output for input ``x`` (the layer's own input)."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        if self.dropout and self.training:
            x = self._dropout(x)
        hidden = F.linear(x, self.A)
        if self.kind == "column":
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        else:
            hidden = reduce_from_tensor_model_parallel_region(hidden, group=self.tp_group)
        return F.linear(hidden, self.B) * self.scale

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # a replicated input draws the same mask on every TP rank (the default stream is shared within TP);
        # a sharded one draws per-rank masks from Megatron's tensor-parallel stream, as sharded dropout does
        if self.kind == "column":
            return F.dropout(x, self.dropout, training=True)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.dropout, training=True)

    def hook(self, layer, args, kwargs, output):
        """Forward hook on the adapted layer: its ``(output, bias)`` plus this adapter's update."""
        if not self.enabled:
            return output
        x = args[0] if args else next(iter(kwargs.values()))  # Megatron passes the input first (TE names it x)
        out, bias = output
        return out + self.forward(x).to(out.dtype), bias

    def delta(self) -> torch.Tensor:
        """This rank's shard of the update ``scale * B @ A`` in fp32."""
        return torch.mm(self.B.float(), self.A.float()).mul_(self.scale)

    def update_norm_sq(self) -> torch.Tensor:
        """``||scale B A||^2 = scale^2 <B^T B, A A^T>``, from rank x rank products (no full-size tensor)."""
        b, a = self.B.float(), self.A.float()
        return (b.T @ b * (a @ a.T)).sum() * self.scale ** 2

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``W + scale * B @ A`` in W's dtype (fp32 arithmetic, one rounding).

        Records ``merge_stats`` (device tensor): the squared norm of what rounding to W's dtype dropped
        from the update, and the update's squared norm. In bf16 an update entry below half a unit of W's
        last place is lost to the engine."""
        exact = torch.addmm(weight.float(), self.B.float(), self.A.float(), alpha=self.scale)
        merged, self.merge_stats = _round_merged(exact, weight.dtype, self.update_norm_sq())
        return merged

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron checkpoint entries: the sharded factor split over TP like its layer's weight (fc1's B
        in the same gate/up halves as fc1, so checkpoints reshard across TP sizes), the other replicated."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axes = {"B": 0} if self.kind == "column" else {"A": 1}
        state = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                    sharded_offsets, tp_group=self.tp_group,
                                                    dp_cp_group=metadata["dp_cp_group"])
        if self.gated:
            key = f"{prefix}B"
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets,
                                                      metadata.get("singleton_local_shards", False),
                                                      tp_group=self.tp_group, dp_group=metadata["dp_cp_group"])
        return state


def _round_merged(exact: torch.Tensor, dtype: torch.dtype, update_sq: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``exact`` (fp32) rounded to ``dtype``, and the merge stats [lost squared norm, update squared norm]."""
    merged = exact.to(dtype)
    lost = exact.sub_(merged).square().sum() if merged.dtype != exact.dtype else exact.new_zeros(())
    return merged, torch.stack([lost, update_sq])


class CanonicalAdapter(torch.nn.Module):
    """One :class:`LoRAAdapter` per HF projection of a fused column-parallel layer (``parts``: q, k, v of
    ``linear_qkv``; gate, up of a gated ``linear_fc1``), each with its own A and B as PEFT holds them. The
    parts' updates are laid out in the fused layer's row order: this rank's ``groups`` blocks, each the
    parts' rows of that block in order (query groups for QKV, one block for gate/up)."""

    def __init__(self, name: str, rows: dict[str, int], in_features: int, groups: int, config: LoRAConfig, *,
                 tp: TPGroup, like: torch.Tensor, seed: int):
        """``rows``: each part's full output features, in the fused layer's order."""
        super().__init__()
        self.name, self.kind, self.groups, self.enabled = name, "column", groups, True
        self.parts = torch.nn.ModuleDict({part: LoRAAdapter(f"{name}.{part}", "column", (out, in_features), config,
                                                            tp=tp, like=like, seed=seed)
                                          for part, out in rows.items()})

    def _fuse(self, tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The parts' ``tensors`` (split along ``dim``) interleaved block by block into the fused order."""
        dim %= tensors[0].dim()
        blocks = [t.unflatten(dim, (self.groups, -1)) for t in tensors]
        return torch.cat(blocks, dim=dim + 1).flatten(dim, dim + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fuse([part(x) for part in self.parts.values()], dim=-1)

    hook = LoRAAdapter.hook

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``W`` plus every part's update in the fused order (fp32, one rounding)."""
        exact = weight.float() + self._fuse([part.delta() for part in self.parts.values()], dim=0)
        update_sq = torch.stack([part.update_norm_sq() for part in self.parts.values()]).sum()
        merged, self.merge_stats = _round_merged(exact, weight.dtype, update_sq)
        return merged

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The parts' checkpoint entries (each B split over TP by rows, as a column layer's)."""
        return {key: value for name, part in self.parts.items()
                for key, value in part.sharded_state_dict(f"{prefix}parts.{name}.", sharded_offsets,
                                                          metadata).items()}


def _canonical_rows(target: str, model_config, out_features: int, tp: int) -> tuple[dict[str, int], int] | None:
    """(full rows of each part, fused blocks per TP rank) of a canonical adapter on ``target``; None where
    the layer fuses nothing (a non-gated ``linear_fc1``)."""
    if target == "linear_qkv":
        heads = model_config.num_attention_heads
        groups = model_config.num_query_groups or heads
        head_dim = model_config.kv_channels
        rows = dict(zip(CANONICAL_PARTS[target], (heads * head_dim, groups * head_dim, groups * head_dim)))
        blocks = groups // tp
    elif target == "linear_fc1" and model_config.gated_linear_unit:
        rows, blocks = dict.fromkeys(CANONICAL_PARTS[target], out_features // 2), 1
    else:
        return None
    if sum(rows.values()) != out_features:
        raise LoRAError(f"canonical LoRA on {target}: parts {rows} do not add up to the layer's {out_features} rows")
    return rows, blocks


def _make_adapter(name: str, target: str, linear: torch.nn.Module, model_config, config: LoRAConfig,
                  tp: TPGroup, seed: int) -> torch.nn.Module:
    """The adapter of one targeted layer: canonical (one per HF projection) where asked and fused."""
    kind = _layer_kind(name, linear, target)
    out_features, in_features = _full_shape(linear, kind, tp.size)
    canonical = _canonical_rows(target, model_config, out_features, tp.size) if config.canonical else None
    smallest = min(in_features, *(canonical[0].values() if canonical else (out_features,)))
    if config.rank > smallest:
        raise LoRAError(f"LoRA rank {config.rank} is larger than layer {name} ({out_features} x {in_features}"
                        f"{', canonical parts ' + str(canonical[0]) if canonical else ''}): a low-rank update "
                        f"needs rank <= {smallest}")
    if canonical:
        return CanonicalAdapter(name, canonical[0], in_features, canonical[1], config, tp=tp, like=linear.weight,
                                seed=seed)
    return LoRAAdapter(name, kind, (out_features, in_features), config, tp=tp, like=linear.weight, seed=seed,
                       gated=target == "linear_fc1" and model_config.gated_linear_unit)


def _layer_kind(name: str, layer: torch.nn.Module, target: str) -> str:
    kind = TARGET_KINDS[target]
    expected = _COLUMN_CLASSES if kind == "column" else _ROW_CLASSES
    if type(layer).__name__ not in expected:
        raise LoRAError(f"LoRA target {name}: a {type(layer).__name__}, not one of the layer kinds LoRA supports "
                        f"for {target} ({', '.join(expected)}); a layer-norm-fused linear needs the unfused "
                        f"layer spec")
    return kind


def _full_shape(layer: torch.nn.Module, kind: str, tp_size: int) -> tuple[int, int]:
    out_rows, in_cols = layer.weight.shape
    return (out_rows * tp_size, in_cols) if kind == "column" else (out_rows, in_cols * tp_size)


def attach_lora(model: torch.nn.Module, config: LoRAConfig, *, seed: int, trainable: tuple[str, ...] = ()) -> int:
    """Puts an adapter on every targeted layer of ``model`` (this rank's stage of a GPTModel, before DDP
    wraps it) and freezes every other parameter except those whose name is in ``trainable``. Returns the
    number of adapters. Errors name the layer: a target no layer matches, a rank larger than a layer."""
    from megatron.core import parallel_state as ps

    if adapters_of(model):
        raise LoRAError("attach_lora: the model already has LoRA adapters")
    if getattr(model.config, "sequence_parallel", False):
        raise LoRAError("LoRA with sequence parallelism is not supported (the adapters read the layers' "
                        "un-gathered inputs)")
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    tp = TPGroup(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                 ps.get_tensor_model_parallel_group())
    _refuse_expert_targets(layers, config.targets)
    found = {t: 0 for t in config.targets}
    new = []
    for layer in layers:
        for target in config.targets:
            block = getattr(layer, TARGET_BLOCKS[target], None)
            linear = getattr(block, target, None) if block is not None else None
            if linear is None:
                continue
            name = f"decoder.layers.{layer.layer_number - 1}.{TARGET_BLOCKS[target]}.{target}"
            adapter = _make_adapter(name, target, linear, model.config, config, tp, seed)
            new.append((block, target, linear, adapter))
            found[target] += 1
    # every stage holds layers, so a target that matches nothing here matches nothing anywhere
    missing = [t for t, n in found.items() if not n]
    if missing and layers:
        raise LoRAError(f"LoRA targets {missing} match no layer of this model (its layers hold "
                        f"{', '.join(n for n, _ in layers[0].named_children())})")
    model.requires_grad_(False)
    for name, param in model.named_parameters():
        if name in trainable:
            param.requires_grad_(True)
    for block, target, linear, adapter in new:
        block.add_module(target + SUFFIX, adapter)
        linear.register_forward_hook(adapter.hook, with_kwargs=True)
    if getattr(model, "embedding", None) is not None:
        model.embedding.register_forward_hook(_require_grad)
    return len(new)


def _refuse_expert_targets(layers, targets: list[str]) -> None:
    """LoRA adapts the dense MLP's ``linear_fc1``/``linear_fc2``, not the experts of a mixture-of-experts
    block (routed experts run as grouped GEMMs, a shared expert beside them): targeting them on a model
    with MoE blocks is refused, naming the layers, rather than adapting only its dense layers."""
    mlp_targets = [t for t in targets if TARGET_BLOCKS[t] == "mlp"]
    moe_layers = [layer.layer_number - 1 for layer in layers if hasattr(getattr(layer, "mlp", None), "experts")]
    if mlp_targets and moe_layers:
        attention = [t for t in TARGET_KINDS if TARGET_BLOCKS[t] == "self_attention"]
        raise LoRAError(f"LoRA targets {mlp_targets}: layers {moe_layers} of this model are mixture-of-experts "
                        f"blocks, whose experts LoRA does not adapt; set model.lora.targets={attention} "
                        f"(the attention layers) or train without LoRA")


def _require_grad(module, args, output):
    """The frozen embedding's output as a tensor that requires grad. Megatron's activation recomputation
    (``CheckpointFunction``) builds a backward graph only when an input of the recomputed chunk requires
    grad; with everything before the first layer frozen none does, and the adapters inside would get
    no gradient (an error, or silently none)."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def adapters_of(model: torch.nn.Module) -> list[LoRAAdapter]:
    """Every pair of LoRA factors (a canonical adapter's parts one by one)."""
    return [m for m in model.modules() if isinstance(m, LoRAAdapter)]


def adapter_parameter_names(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s LoRA factors among its parameters (what no base checkpoint holds)."""
    factors = {id(p) for m in adapters_of(model) for p in m.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in factors}


def layer_adapters(model: torch.nn.Module) -> list[LoRAAdapter | CanonicalAdapter]:
    """The adapter of each adapted layer (what its forward hook applies and what a merge uses)."""
    parts = {id(p) for m in model.modules() if isinstance(m, CanonicalAdapter) for p in m.parts.values()}
    return [m for m in model.modules() if isinstance(m, (LoRAAdapter, CanonicalAdapter)) and id(m) not in parts]


def merge_rounding(model: torch.nn.Module) -> float | None:
    """How much of the adapters' update the last merge lost to rounding, ``||lost|| / ||update||`` over this
    rank's adapters (0 in fp32; None without adapters or merges). One host read."""
    stats = [a.merge_stats for a in layer_adapters(model) if getattr(a, "merge_stats", None) is not None]
    if not stats:
        return None
    lost, update = torch.stack(stats).double().sum(0).tolist()  # host: one read per sync
    return math.sqrt(lost / update) if update > 0 else 0.0


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Inside: the model computes as its frozen base (every adapter off); each adapter's state is restored
    on exit (so the contexts nest)."""
    adapters = layer_adapters(model)
    before = [adapter.enabled for adapter in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, enabled in zip(adapters, before):
            adapter.enabled = enabled


def merged_weight(model: torch.nn.Module, param_name: str, param: torch.Tensor) -> torch.Tensor:
    """The tensor a sync or export sends for ``param_name``: merged with its layer's enabled adapter, if
    any (:meth:`LoRAAdapter.merged`), else the parameter itself (detached)."""
    module_path, _, leaf = param_name.rpartition(".")
    if leaf != "weight":
        return param.detach()
    parent_path, _, child = module_path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
    except AttributeError:
        return param.detach()
    adapter = getattr(parent, child + SUFFIX, None)
    if isinstance(adapter, (LoRAAdapter, CanonicalAdapter)) and adapter.enabled:
        return adapter.merged(param.detach())
    return param.detach()


class AdaptersOff(torch.nn.Module):
    """A view of a LoRA model that runs it with every adapter off (the reference policy). It shares the
    model's parameters: nothing is copied. ``module`` lets Megatron's schedule find the model inside."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.module):
            return self.module(*args, **kwargs)
