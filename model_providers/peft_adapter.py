"""LoRA adapters of a Megatron model <-> a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the HF base model.

The adapter table is derived from the architecture's own weight table: the entry of each targeted
layer names its HF projections (``linear_qkv`` -> ``q_proj, k_proj, v_proj``) and its kind, which lays
out B exactly as it lays out the weight (fused QKV groups, per-rank gate/up halves). A of a fused
column-parallel layer is one tensor that PEFT stores once per projection (:class:`Shared`); A of a
row-parallel layer is split over TP like its weight. With ``model.lora.canonical`` a fused layer holds one
adapter per projection (``parallel.lora.CanonicalAdapter``): each part's A is its projection's A, and its
B is split over TP by rows like a column-parallel weight. :func:`iter_hf_weights` then gathers adapters over
TP and pipeline stages as it gathers weights, so there is one gathering path.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from model_providers.base import ModelProvider
from model_providers.hf_checkpoint import (HFCheckpoint, _bind, _replace_dir, _tp_context, iter_hf_weights, load_bound,
                                          unwrap)
from model_providers.mapping import COLUMN, REPLICATED, ROW, Shared, WeightMapping
from parallel.lora import CANONICAL_PARTS, SUFFIX, TARGET_BLOCKS, TARGET_KINDS, LoRAError
from megarlhf.config.model import LoRAConfig
from megarlhf.core.outputs import check_replaceable, write_output_marker

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _base_entry(provider: ModelProvider, target: str) -> WeightMapping:
    megatron = f"decoder.layers.{{layer}}.{TARGET_BLOCKS[target]}.{target}.weight"
    for mapping in provider.body_mappings:
        if mapping.megatron == megatron:
            return mapping
    raise LoRAError(f"{provider.model_type}: no weight-table entry for {megatron}; LoRA cannot target {target}")


def adapter_table(provider: ModelProvider, lora: LoRAConfig) -> tuple[list[WeightMapping], dict]:
    """(mappings, HF shapes) of the PEFT tensors of every targeted layer, for :func:`iter_hf_weights`."""
    mappings, shapes = [], {}
    base_shapes = provider.hf_tensor_shapes("none")
    for target in lora.targets:
        base = _base_entry(provider, target)
        modules = [name.removesuffix(".weight") for name in base.hf]
        a_names = tuple(f"{PEFT_PREFIX}{m}.lora_A.weight" for m in modules)
        b_names = tuple(f"{PEFT_PREFIX}{m}.lora_B.weight" for m in modules)
        adapter = base.megatron.removesuffix(".weight") + SUFFIX
        column = TARGET_KINDS[target] == "column"
        if lora.canonical and len(modules) > 1:  # one adapter per projection: parallel.lora.CanonicalAdapter
            for part, a_name, b_name in zip(CANONICAL_PARTS[target], a_names, b_names, strict=True):
                mappings.append(WeightMapping(f"{adapter}.parts.{part}.A", (a_name,), REPLICATED))
                mappings.append(WeightMapping(f"{adapter}.parts.{part}.B", (b_name,), COLUMN))
        else:
            mappings.append(WeightMapping(adapter + ".A", a_names, Shared(len(modules)) if column else ROW))
            mappings.append(WeightMapping(adapter + ".B", b_names, base.kind if column else REPLICATED))
        for layer in range(provider.hf_config.num_hidden_layers):
            for module, a_name, b_name in zip(modules, a_names, b_names):
                out_features, in_features = base_shapes[f"{module}.weight".format(layer=layer)]
                shapes[a_name.format(layer=layer)] = (lora.rank, in_features)
                shapes[b_name.format(layer=layer)] = (out_features, lora.rank)
    return mappings, shapes


def target_modules(provider: ModelProvider, lora: LoRAConfig) -> list[str]:
    """The HF projections ``lora`` adapts (PEFT's ``target_modules``), e.g. ``["k_proj", "q_proj", "v_proj"]``."""
    return sorted({name.removesuffix(".weight").rsplit(".", 1)[-1]
                   for target in lora.targets for name in _base_entry(provider, target).hf})


def peft_config(provider: ModelProvider, lora: LoRAConfig, base_model: str) -> dict:
    """``adapter_config.json`` of a PEFT LoRA adapter equal to ``lora``."""
    modules = target_modules(provider, lora)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def peft_tensors(model: torch.nn.Module, provider: ModelProvider, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """The model's adapters as PEFT-named full tensors, on every rank (collective over all ranks: the TP
    and pipeline gathers of :func:`iter_hf_weights`)."""
    table = adapter_table(provider, lora)
    tensors = dict(iter_hf_weights(model, provider, table=table))
    missing = sorted(set(table[1]) - set(tensors))
    if missing:
        raise LoRAError(f"adapter export lacks {len(missing)} tensor(s), e.g. {missing[:3]}: the model has no "
                        f"adapters for targets {lora.targets}")
    return tensors


def write_peft_adapter(tensors: dict[str, torch.Tensor], adapter_config: dict, out: Path,
                       overwrite: bool = False) -> None:
    """Writes ``tensors`` (:func:`peft_tensors`) and ``adapter_config`` (:func:`peft_config`) as the PEFT
    adapter directory ``out``, atomically (written beside it, then renamed), marked as megarlhf's; an existing
    non-empty ``out`` is replaced only with ``overwrite`` and only when megarlhf wrote it. Local to this process."""
    from safetensors.torch import save_file

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    write_output_marker(tmp, "peft_adapter", base_model=adapter_config.get("base_model_name_or_path"))
    _replace_dir(tmp, out, overwrite)


def export_peft_adapter(model: torch.nn.Module, provider: ModelProvider, lora: LoRAConfig, out_dir: str | Path, *,
                        base_model: str, overwrite: bool = False) -> Path:
    """Writes the model's adapters as a PEFT adapter directory; collective over all ranks, global rank 0
    writes. The directory appears atomically (written beside it, then renamed)."""
    out = Path(out_dir).absolute()
    check_replaceable(out, overwrite, "adapter export target")
    tensors = peft_tensors(model, provider, lora)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_peft_adapter(tensors, peft_config(provider, lora, base_model), out, overwrite)
    if dist.is_initialized():
        dist.barrier()
    return out


def _check_shared_factors(path: Path, mappings: list[WeightMapping]) -> None:
    """A fused layer's projections share one A: refuses, naming them, an adapter whose A factors differ."""
    from safetensors import safe_open

    with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as source:
        held = set(source.keys())
        for mapping in mappings:
            if not isinstance(mapping.kind, Shared):
                continue
            for layer in range(10**6):
                names = mapping.hf_names(layer)
                if not all(n in held for n in names):
                    break
                first = source.get_tensor(names[0])
                if any(not torch.equal(first, source.get_tensor(n)) for n in names[1:]):
                    raise LoRAError(f"PEFT adapter {path}: {', '.join(names)} differ, but model.lora shares one A "
                                    f"across them (a fused Megatron layer); set model.lora.canonical=true to "
                                    f"hold one adapter per projection, as PEFT does")


@torch.no_grad()
def load_peft_adapter(model: torch.nn.Module, provider: ModelProvider, lora: LoRAConfig, adapter: str | Path) -> None:
    """Copies a PEFT LoRA adapter directory into this rank's adapters of ``model`` (attached with
    ``lora``) through the HF loader (:func:`load_bound`: each rank reads its TP slice). Errors name what
    does not fit: a different rank or scale, a missing tensor or shape, q/k/v (or gate/up) A factors that
    differ where the fused layers hold one (not ``lora.canonical``)."""
    path = Path(adapter)
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise LoRAError(f"PEFT adapter {path}: needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    saved = json.loads(config_file.read_text())
    unsupported = {key: saved[key] for key in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
                                               "modules_to_save", "layers_to_transform") if saved.get(key)}
    if saved.get("bias", "none") != "none":
        unsupported["bias"] = saved["bias"]
    if saved.get("peft_type", "LORA") != "LORA":
        unsupported["peft_type"] = saved["peft_type"]
    if unsupported:
        raise LoRAError(f"PEFT adapter {path}: {unsupported} is not a plain LoRA adapter megarlhf represents")
    if saved.get("r") != lora.rank or float(saved.get("lora_alpha", 0)) / lora.rank != lora.scale:
        raise LoRAError(f"PEFT adapter {path}: r={saved.get('r')}, lora_alpha={saved.get('lora_alpha')}, but "
                        f"model.lora has rank={lora.rank}, alpha={lora.alpha}")
    mappings, shapes = adapter_table(provider, lora)
    if not lora.canonical:
        _check_shared_factors(path, mappings)
    with HFCheckpoint(path, single_file=ADAPTER_WEIGHTS) as ckpt:
        load_bound(ckpt, _bind(unwrap(model), mappings), shapes, _tp_context(provider))
