"""HF safetensors checkpoints <-> this rank's shards of a Megatron GPTModel, through the mapping tables.

* :func:`load_hf_weights` fills a freshly built (sharded, pipeline-staged) model from an HF directory;
  every rank opens only the files holding its stage's tensors and reads only its TP slice of each.
* :func:`iter_hf_weights` yields ``(hf_name, full tensor)`` from the live sharded model on every rank
  (TP all-gather inside the owning stage, then a broadcast over the pipeline group), in a fixed order:
  embedding, then layer by layer, then final norm and head; used by the export below and by the vLLM
  weight sync, so there is exactly one Megatron -> HF path.
* :func:`export_hf_checkpoint` writes an HF directory (config, safetensors sharded with an index when
  large, tokenizer and generation config copied from the source) atomically from global rank 0.

The per-rank partial reads and the TP/PP gathers follow Megatron's sharding, which no
HF-side library knows; safetensors does the actual file I/O.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterator

import torch
import torch.distributed as dist

from megarlhf.core.errors import CheckpointError
from megarlhf.core.outputs import apply_umask, check_replaceable, write_output_marker
from model_providers.base import ModelProvider
from model_providers.mapping import WeightMapping
from parallel.runtime import model_groups

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files copied verbatim from the source checkpoint on export (tokenizer and generation settings).
COPIED_FILE_PATTERN = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|chat_template.*"
    r"|generation_config\.json|.*\.tiktoken|.*sentencepiece.*\.model|spiece\.model)$")
# Transformer Engine's spec fuses the pre-attention / pre-MLP norms into the following linear layer.
TE_FUSED_NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                       "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


class _LazySlice:
    """A safetensors slice with ``.shape`` and torch-tensor slicing (what the mapping kinds read)."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]


class HFCheckpoint:
    """The safetensors files of an HF model directory, single-file or sharded with an index."""

    def __init__(self, path: str | Path, single_file: str = SINGLE_FILE):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"HF checkpoint directory {self.path} does not exist")
        index, single = self.path / SAFETENSORS_INDEX, self.path / single_file
        if index.is_file():
            self.weight_map = dict(json.loads(index.read_text())["weight_map"])
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(single, framework="pt") as handle:
                self.weight_map = {name: single_file for name in handle.keys()}
        else:
            raise CheckpointError(f"no {single_file} or {SAFETENSORS_INDEX} in HF checkpoint directory {self.path}")
        missing = sorted({f for f in self.weight_map.values() if not (self.path / f).is_file()})
        if missing:
            raise CheckpointError(f"HF checkpoint {self.path}: {SAFETENSORS_INDEX} lists missing files {missing}")
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def source(self, name: str) -> _LazySlice:
        from safetensors import safe_open

        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.path / file, framework="pt")
        return _LazySlice(self._handles[file], name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class _Bound:
    """One mapping entry applied to one parameter of this rank's model stage."""

    mapping: WeightMapping
    param_name: str
    param: torch.nn.Parameter
    hf_names: tuple[str, ...]
    order: tuple[int, int, int]  # global position: (section, global layer, table index)
    expert: int | None = None  # the global routed expert (per-expert entries; all experts share an order)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _bind(model: torch.nn.Module, mappings: list[WeightMapping], num_experts: int = 0) -> list[_Bound]:
    """The table applied to this rank's parameters; per-expert entries once per local expert."""
    params = dict(model.named_parameters())
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    global_layer = {local: layer.layer_number - 1 for local, layer in enumerate(layers)}
    ep = model_groups().ep
    ep_rank, ep_size = ep.rank, ep.size
    local_experts = num_experts // ep_size
    bound = []
    for idx, mapping in enumerate(mappings):
        if mapping.per_expert:  # absent at dense layers of an MoE model, which the dense entries cover
            targets = [(mapping.megatron.format(layer=local, expert=i), mapping.hf_names(g, ep_rank * local_experts + i),
                        (1, g), ep_rank * local_experts + i)
                       for local, g in global_layer.items() for i in range(local_experts)]
        elif mapping.per_layer:
            targets = [(mapping.megatron.format(layer=local), mapping.hf_names(g), (1, g), None)
                       for local, g in global_layer.items()]
        else:
            section = 0 if mapping.megatron.startswith("embedding.") else 2
            targets = [(mapping.megatron, mapping.hf, (section, 0), None)]
        for name, hf_names, (section, layer), expert in targets:
            if name not in params:
                for local_name, te_name in TE_FUSED_NORM_NAMES.items():
                    if name.endswith(local_name) and name[:-len(local_name)] + te_name in params:
                        name = name[:-len(local_name)] + te_name
            if name in params:  # absent: this entry lives on another pipeline stage (or another MLP kind)
                bound.append(_Bound(mapping, name, params[name], hf_names, (section, layer, idx), expert))
    return bound


def _num_experts(provider: ModelProvider) -> int:
    return provider.num_experts if provider.is_moe else 0


def _tp_context(provider: ModelProvider):
    tp = model_groups().tp
    return provider.shard_context(tp.rank, tp.size)


def _expert_tp_context(provider: ModelProvider):
    etp = model_groups().etp
    return provider.shard_context(etp.rank, etp.size)


def _check_names_and_shapes(ckpt: HFCheckpoint, bound: list[_Bound], expected: dict) -> None:
    needed = sorted({n for b in bound for n in b.hf_names})
    missing = [n for n in needed if n not in ckpt]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"HF checkpoint {ckpt.path} is missing {len(missing)} tensor(s): {shown}")
    for name in needed:
        actual = ckpt.source(name).shape
        if name in expected and actual != expected[name]:
            raise CheckpointError(f"HF checkpoint {ckpt.path}: tensor {name} in {ckpt.weight_map[name]} has shape "
                                  f"{list(actual)}, but the config expects {list(expected[name])}")


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, provider: ModelProvider, hf_dir: str | Path, *, head: str = "lm",
                    allow_unmapped: Collection[str] = ()) -> None:
    """Copies an HF checkpoint into this rank's shards of ``model`` (built by ``provider.build_model``).

    Every parameter must be covered by the mapping table except those named in ``allow_unmapped`` (e.g. a
    freshly initialised value head). Errors name missing files/tensors and mismatched shapes.
    """
    model = unwrap(model)
    bound = _bind(model, provider.mappings(head), _num_experts(provider))
    covered = {b.param_name for b in bound}
    unmapped = [n for n, _ in model.named_parameters() if n not in covered and n not in allow_unmapped]
    if unmapped:
        raise CheckpointError(f"{provider.model_type} mapping table covers no HF tensor for Megatron parameters "
                              f"{unmapped}")
    with HFCheckpoint(hf_dir) as ckpt:
        load_bound(ckpt, bound, provider.hf_tensor_shapes(head), _tp_context(provider),
                   _expert_tp_context(provider) if provider.is_moe else None)


@torch.no_grad()
def load_bound(ckpt: HFCheckpoint, bound: list[_Bound], shapes: dict, ctx, expert_ctx=None) -> None:
    """Copies the HF tensors of ``bound`` entries from ``ckpt`` into their parameters, each rank reading
    only its slices (of the expert tensor-parallel split for routed experts, ``expert_ctx``), after
    checking every name and shape against ``shapes``."""
    _check_names_and_shapes(ckpt, bound, shapes)
    for b in bound:
        try:
            shard = b.mapping.kind.load([ckpt.source(n) for n in b.hf_names], ctx if b.expert is None else expert_ctx)
        except ValueError as err:
            raise CheckpointError(f"{ckpt.path}: {b.param_name} from {list(b.hf_names)}: {err}") from None
        if tuple(shard.shape) != tuple(b.param.shape):
            raise CheckpointError(f"{b.param_name}: HF tensors {list(b.hf_names)} give a shard of shape "
                                  f"{list(shard.shape)}, the Megatron parameter has {list(b.param.shape)}")
        b.param.copy_(shard)


def _stage_schedule(groups: dict[tuple, list[_Bound]], num_experts: int
                    ) -> list[tuple[tuple, tuple[str, ...], str, int]]:
    """The global export order as (order, hf names, dtype, owning pipeline stage), the same on every rank.
    A per-expert entry is one item whose names are every global expert's, expert after expert."""
    local = []
    for order, bound in groups.items():
        b = bound[0]
        names = b.hf_names if b.expert is None else tuple(
            n for e in range(num_experts) for n in b.mapping.hf_names(order[1], e))
        local.append((order, names, str(b.param.dtype).removeprefix("torch.")))
    pp = model_groups().pp
    per_stage = [local]
    if pp.size > 1:
        per_stage = [None] * pp.size
        dist.all_gather_object(per_stage, local, group=pp.group)
    return sorted((order, names, dtype, stage) for stage, entries in enumerate(per_stage)
                  for order, names, dtype in entries)


def _gather_shards(shard: torch.Tensor, ctx, group) -> list[torch.Tensor]:
    """Every tensor-parallel rank's shard of one parameter, in rank order."""
    if ctx.tp_size == 1:
        return [shard]
    local = shard.contiguous()
    shards = [torch.empty_like(local) for _ in range(ctx.tp_size)]
    dist.all_gather(shards, local, group=group)
    return shards


def _all_experts(bound: list[_Bound], ctx) -> list[torch.Tensor]:
    """The HF tensors of one per-expert entry for every global expert (expert after expert): each rank's
    local experts, gathered over the expert tensor-parallel group, then stacked and gathered over the
    expert-parallel group in one collective per HF tensor."""
    layout = model_groups()
    etp_group = layout.etp.group if ctx.tp_size > 1 else None
    kind = bound[0].mapping.kind
    local = [kind.export(_gather_shards(b.param, ctx, etp_group) if kind.tp_sharded else [b.param], ctx)
             for b in sorted(bound, key=lambda b: b.expert)]
    per_position = [torch.stack([tensors[j] for tensors in local]) for j in range(kind.num_hf)]
    if layout.ep.size > 1:
        gathered = []
        for stacked in per_position:
            parts = [torch.empty_like(stacked) for _ in range(layout.ep.size)]
            dist.all_gather(parts, stacked.contiguous(), group=layout.ep.group)
            gathered.append(torch.cat(parts))
        per_position = gathered
    return [per_position[j][e] for e in range(per_position[0].shape[0]) for j in range(kind.num_hf)]


@torch.no_grad()
def iter_hf_weights(model: torch.nn.Module, provider: ModelProvider, *, head: str = "lm",
                    dtype: torch.dtype | None = None, copies: bool = True,
                    table: tuple[list[WeightMapping], dict] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields every HF-named full tensor of the live sharded model, on every rank, in a fixed order.

    Collective: all ranks of the model-parallel group must iterate to the end together (with experts, the
    expert-parallel group too). Tensors are fresh copies (cast to ``dtype`` if given), so callers may keep
    or bucket them; ``copies=False`` (the weight sync, whose engine copies each tensor into its own
    parameters at once) skips the copy where the tensor is already contiguous: it may then be a view of a
    live parameter. A weight with a LoRA adapter is sent merged with it (:func:`parallel.lora.merged_weight`).
    ``table``: another ``(mappings, HF shapes)`` to read instead of the provider's (the PEFT adapter export).
    """
    from parallel.lora import merged_weight

    model = unwrap(model)
    mappings, shapes = table if table is not None else (provider.mappings(head), provider.hf_tensor_shapes(head))
    groups: dict[tuple, list[_Bound]] = {}
    for b in _bind(model, mappings, _num_experts(provider)):
        if b.mapping.export:
            groups.setdefault(b.order, []).append(b)
    ctx = _tp_context(provider)
    device = next(model.parameters()).device
    layout = model_groups()
    tp_group, pp_group = layout.tp.group, layout.pp.group
    pp_rank, pp_size = layout.pp.rank, layout.pp.size
    for order, hf_names, dtype_name, stage in _stage_schedule(groups, _num_experts(provider)):
        if stage == pp_rank and groups[order][0].expert is not None:
            tensors = _all_experts(groups[order], _expert_tp_context(provider))
        elif stage == pp_rank:
            b = groups[order][0]
            weight = merged_weight(model, b.param_name, b.param)
            shards = _gather_shards(weight, ctx, tp_group) if b.mapping.kind.tp_sharded else [weight]
            tensors = [t.contiguous().clone() if copies else t.contiguous() for t in b.mapping.kind.export(shards, ctx)]
        else:
            tensors = [torch.empty(shapes[n], dtype=getattr(torch, dtype_name), device=device) for n in hf_names]
        if pp_size > 1:
            src = dist.get_global_rank(pp_group, stage)
            for t in tensors:
                dist.broadcast(t, src=src, group=pp_group)
        for name, tensor in zip(hf_names, tensors):
            yield name, tensor if dtype is None else tensor.to(dtype)


class _ShardWriter:
    """Streams tensors into safetensors files of at most ``max_shard_bytes`` each, then names them HF-style."""

    def __init__(self, directory: Path, max_shard_bytes: int):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending or not self.files:
            self._flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.directory / SINGLE_FILE)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _export_config(provider: ModelProvider, head: str, dtype: torch.dtype):
    config = copy.deepcopy(provider.hf_config)
    if head == "value":
        config.architectures = [provider.hf_sequence_classifier]
        config.num_labels = 1
    else:
        config.architectures = [provider.hf_causal_lm]
    config.dtype = dtype
    return config


def _replace_dir(tmp: Path, out: Path, overwrite: bool) -> None:
    """Renames the finished ``tmp`` to ``out`` (an old ``out`` set aside, then deleted), with umask modes."""
    apply_umask(tmp)
    check_replaceable(out, overwrite, "export target")  # something may have appeared there meanwhile
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def export_hf_checkpoint(model: torch.nn.Module, provider: ModelProvider, out_dir: str | Path, *,
                         source_dir: str | Path | None = None, head: str = "lm", dtype: torch.dtype | None = None,
                         max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> Path:
    """Writes the sharded model as an HF directory; collective over all ranks, global rank 0 writes.

    ``head="value"`` exports a reward/critic model under ``...ForSequenceClassification`` names.
    ``dtype`` defaults to the source config's dtype. Tokenizer and generation-config files are copied from
    ``source_dir``. The directory appears atomically (written beside it, then renamed), marked as
    megarlhf's, with the modes the umask gives; an existing non-empty one is replaced only with
    ``overwrite=True`` and only when megarlhf wrote it (:mod:`megarlhf.core.outputs`).
    """
    out = Path(out_dir).absolute()
    rank = dist.get_rank() if dist.is_initialized() else 0
    check_replaceable(out, overwrite, "export target")
    dtype = dtype or getattr(provider.hf_config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    writer = None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        writer = _ShardWriter(tmp, max_shard_bytes)
    written = set()
    for name, tensor in iter_hf_weights(model, provider, head=head, dtype=dtype):
        written.add(name)
        if writer is not None:
            writer.add(name, tensor)
    expected = set(provider.hf_tensor_shapes(head))
    if written != expected:
        raise CheckpointError(f"export produced tensors {sorted(written - expected)} not in the HF layout and "
                              f"lacks {sorted(expected - written)}")
    if writer is not None:
        writer.finish()
        _export_config(provider, head, dtype).save_pretrained(tmp)
        if source_dir is not None:
            for path in sorted(Path(source_dir).iterdir()):
                if path.is_file() and COPIED_FILE_PATTERN.match(path.name):
                    shutil.copy2(path, tmp / path.name)
        write_output_marker(tmp, f"hf_model/{head}", source=None if source_dir is None else str(source_dir))
        _replace_dir(tmp, out, overwrite)
    if dist.is_initialized():
        dist.barrier()
    return out


def build_hf_model(hf_dir: str | Path, params_dtype: torch.dtype = torch.float32, **config_overrides):
    """Builds this rank's stage of the model described by ``hf_dir`` without its weights: the parameters are
    allocated, not initialised (``perform_initialization=False`` unless overridden), for
    :func:`load_hf_weights` to write every one of them (it refuses a parameter it does not cover); drawing
    135M normals that the load overwrites took 1.4 s of SmolLM2's start-up.

    Returns ``(provider, model)``. Megatron's parallel state must be initialised first.
    """
    from model_providers import get_provider

    if not (Path(hf_dir) / "config.json").is_file():
        raise CheckpointError(f"HF checkpoint directory {hf_dir} has no config.json")
    provider = get_provider(hf_dir)
    return provider, provider.build_model(params_dtype, **{"perform_initialization": False, **config_overrides})


def load_hf_model(hf_dir: str | Path, params_dtype: torch.dtype = torch.float32, **config_overrides):
    """Builds this rank's stage of the model described by ``hf_dir`` (:func:`build_hf_model`) and loads its
    weights. Returns ``(provider, model)``."""
    provider, model = build_hf_model(hf_dir, params_dtype, **config_overrides)
    load_hf_weights(model, provider, hf_dir)
    return provider, model
