"""The engine side of the verified weight sync: fingerprints of the parameters a vLLM model computes with.

After a reload, :func:`parameter_report` fingerprints (:mod:`megarlhf.rollout.engines.fingerprint`) every
parameter of the engine's model as its kernels read it, in the engine's own layout (vLLM fuses
``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``; :func:`fused_parameters`
tells the trainer how, so it can predict those fingerprints from the HF tensors it sends).

A parameter that vLLM turns into a kernel-specific form after loading (on CPU linear weights are packed
for oneDNN and the parameter is left empty) is fingerprinted as its layer's quant method receives it
for that processing (:class:`ProcessingCapture`): the last point its values exist as a tensor. Every
other parameter is fingerprinted once, after the reload, where the kernels read it; a float32 copy that a
kernel keeps of a parameter of the model's lower-precision dtype (vLLM's AMX path for small GEMMs on CPU
upcasts the bias) is fingerprinted in the model's dtype when that holds its values exactly (the kernel
reads the same values), else as it is (:func:`as_model_dtype`). A layer with such
processing that did not run during this reload (a tied LM head vLLM's reload skips, a bucket that never
arrived) is reported as a problem: its kernels may still use the previous weights. The routed experts of
an MoE layer, stacked in two parameters that the MoE kernel pads and prepacks, are reported one HF tensor at
a time, as the loader wrote them (:func:`expert_slices`), so any padding of the engine's layout is its own
business; their preparation for the kernel is then re-run (:func:`prepare_experts`).

With LoRA enabled (adapter-only sync, :mod:`megarlhf.rollout.sync.adapters`) vLLM wraps each linear layer
as ``<layer>.base_layer``; reports name parameters without that segment, as the HF checkpoint does, and
:func:`adapter_report` fingerprints the adapter slot the engine's LoRA kernels read.

The report is plain data (lists and dicts of ints), read to the host in one transfer, so it crosses
vLLM's process boundary (disaggregated placement) as it is.
"""
from __future__ import annotations

import logging
import math
import time

import torch

from megarlhf.rollout.engines.fingerprint import fingerprint, fingerprint_many, to_host


LORA_WRAPPER = ".base_layer."  # vLLM's LoRA layer keeps the layer it wraps under this name


def checkpoint_name(name: str) -> str:
    """An engine parameter's name as the checkpoint spells it (without vLLM's LoRA wrapper segment)."""
    return name.replace(LORA_WRAPPER, ".")


def tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules whose weight is another module's parameter (a tied LM head), with a quant method.

    vLLM's in-place reload skips them (no checkpoint tensor is addressed to them), so derived state built
    after loading (on CPU: the oneDNN-packed copy behind ``cpu_linear``) would stay stale: a tied head
    would keep computing logits with the old embedding. They are re-processed after every reload.
    """
    seen, tied = set(), []
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if any(id(p) in seen for p in params) and hasattr(module, "quant_method"):
            tied.append(module)
        seen.update(id(p) for p in params)
    return tied


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # vLLM's in-place reload
_NOT_LOADED = "%s: Failed to load weights"


class ExpectedReloadNotices(logging.Filter):
    """Drops vLLM's ``<Layer>: Failed to load weights`` warning, printed on every in-place reload, for the
    layers a weight sync never addresses: tied LM heads (their weight is the embedding's, sent once) and
    layers holding buffers only (RotaryEmbedding's cos/sin cache, computed by vLLM, not loaded). vLLM puts
    their tensors back as they were, and the sync then fingerprints every parameter the kernels read and
    compares it bit for bit with the trainer's, so a layer that really failed to load fails the sync
    instead. The warning for any other layer is kept. Use as a context manager around the reload (in the
    process that runs it: vLLM's worker)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        buffers_only = {type(m).__name__ for m in model.modules() if next(m.parameters(recurse=False), None) is None
                        and next(m.buffers(recurse=False), None) is not None}
        self.layers = buffers_only | {type(m).__name__ for m in tied_modules(model)}

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _NOT_LOADED and record.args and record.args[0] in self.layers)

    def __enter__(self) -> "ExpectedReloadNotices":
        logging.getLogger(RELOAD_LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(RELOAD_LOGGER).removeFilter(self)


def reprocess_tied(modules: list[torch.nn.Module]) -> None:
    for module in modules:
        module.quant_method.process_weights_after_loading(module)


def fused_parameters(model: torch.nn.Module) -> dict[str, list[str]]:
    """vLLM's fused modules and their HF parts in order, e.g. ``{"qkv_proj": ["q_proj", "k_proj",
    "v_proj"]}`` (the model class's ``packed_modules_mapping``; empty where nothing is fused)."""
    return {fused: list(parts) for fused, parts in getattr(model, "packed_modules_mapping", {}).items()}


def is_expert_layer(module: torch.nn.Module) -> bool:
    """A layer holding an MoE block's routed experts stacked (vLLM's ``w13_weight`` / ``w2_weight``)."""
    return hasattr(module, "get_expert_mapping") and hasattr(module, "w13_weight")


def expert_slices(name: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each routed expert's HF tensors as views of the layer's stacked parameters, in the layout vLLM's
    weight loader writes them (before the MoE kernel prepares them): ``w13_weight`` [experts, 2 x ffn,
    hidden] holds an expert's gate rows from row 0 and its up rows from row ffn, ``w2_weight`` [experts,
    hidden, ffn] its down projection. ``ffn`` and ``hidden`` are the sizes the layer allocated, which may
    exceed the model's when a kernel wants aligned shapes (a GPU build rounds them up at allocation, the
    CPU kernel pads after loading); the checkpoint tensor is the leading block. ``get_expert_mapping()``
    names the checkpoint tensor of every (expert, shard) relative to the MoE block; an expert another engine
    rank holds (``expert_map`` -1) is left out."""
    block = name.split(".experts.")[0]
    config = module.moe_config
    w13, w2 = module.w13_weight, module.w2_weight
    ffn = getattr(config, "intermediate_size_per_partition_unpadded", None) or w2.shape[2]
    hidden = getattr(config, "hidden_dim_unpadded", None) or w2.shape[1]
    up_start = w13.shape[1] // 2
    slot = module.expert_map.tolist() if getattr(module, "expert_map", None) is not None else None
    slices = {}
    for _, weight_name, expert, shard in module.get_expert_mapping():
        local = expert if slot is None else slot[expert]
        if local < 0:
            continue
        if shard == "w2":
            view = w2[local, :hidden, :ffn]
        else:
            start = up_start if shard == "w3" else 0
            view = w13[local, start:start + ffn, :hidden]
        slices[f"{block}.{weight_name}weight"] = view
    return slices


def prepare_experts(layer: torch.nn.Module) -> None:
    """Runs the MoE kernel's own preparation of a reloaded expert layer's weights.

    vLLM (0.32) prepares the experts for its kernel (on CPU: zero-padded to an aligned ffn size, then
    prepacked into the grouped-GEMM layout) only at the first load; a reload leaves the layer in the
    loader's layout and then copies it into the kernel's tensors, which fails when the kernel padded them
    (``The size of tensor a (128) must match the size of tensor b (96)``) and scrambles the experts when it
    only prepacked them. Called on the reloaded layer before that copy, the copy receives the kernel's
    layout. A kernel without such a step (the GPU's fused MoE) leaves the weights as they are."""
    kernel = getattr(layer.quant_method, "moe_kernel", None)
    if kernel is not None:
        kernel.fused_experts.process_weights_after_loading(layer)


def expert_placement(model: torch.nn.Module) -> dict[str, tuple[str, int]]:
    """``hf_name -> (hf_name, 0)`` for every routed expert's tensor: the engine reports each one on its own
    (its slice of the stacked parameters: :func:`expert_slices`), so the trainer fingerprints it as sent,
    whatever padding the engine's layout has. Empty for a dense model."""
    return {hf: (hf, 0) for name, module in model.named_modules() if is_expert_layer(module)
            for hf in expert_slices(name, module)}


def _processed_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules with a quant method and parameters of their own (what vLLM processes after loading)."""
    return {name: m for name, m in model.named_modules()
            if getattr(m, "quant_method", None) is not None and any(True for _ in m.parameters(recurse=False))}


class ProcessingCapture:
    """While active, records which layers vLLM processes after loading and fingerprints what that
    processing turns into a kernel's form, as the quant method's ``process_weights_after_loading`` receives
    it (module docstring): the parameters it leaves empty (packed away), and each routed expert's tensors
    (:func:`expert_slices`; their stacked parameters are then prepared for the MoE kernel:
    :func:`prepare_experts`). Restores the methods on exit. Create it before the reload starts: the
    parameters that are empty then are the packed ones."""

    def __init__(self, model: torch.nn.Module, first_load: bool = False):
        self.seconds = 0.0  # spent fingerprinting (host time: on a GPU, the kernels' launch)
        self.modules = _processed_modules(model)
        self.names = {id(m): name for name, m in self.modules.items()}
        # at a first load nothing is packed yet: every parameter is fingerprinted as processing receives it,
        # and those it packs away are kept (first_load_done)
        self.first_load = first_load
        self.packed = self._emptied()
        # engine parameters reported through their HF parts instead (the stacked experts)
        self.covered = {checkpoint_name(f"{name}.{pname}") for name, m in self.modules.items() if is_expert_layer(m)
                        for pname in ("w13_weight", "w2_weight")}
        self.fingerprints: dict[str, torch.Tensor] = {}
        self.processed: set[str] = set()
        self._wrapped: list[object] = []

    def _capture(self, name: str, layer: torch.nn.Module) -> None:
        start = time.perf_counter()
        for pname, param in layer.named_parameters(recurse=False):
            full = checkpoint_name(f"{name}.{pname}")
            if full in self.packed or (self.first_load and param.numel() > 0):
                self.fingerprints[full] = fingerprint(param)
        if is_expert_layer(layer):
            slices = expert_slices(checkpoint_name(name), layer)
            self.fingerprints.update(zip(slices, fingerprint_many([(view, 0) for view in slices.values()])))
        self.seconds += time.perf_counter() - start

    def __enter__(self) -> "ProcessingCapture":
        for module in self.modules.values():
            method = module.quant_method
            if any(method is w for w in self._wrapped):  # one quant method may serve several layers
                continue
            original = method.process_weights_after_loading

            def process(layer, _original=original):
                name = self.names.get(id(layer))
                if name is not None:
                    self.processed.add(name)
                    self._capture(name, layer)
                reload = getattr(layer.quant_method, "moe_kernel", None) is not None  # a first load prepares
                result = _original(layer)
                if reload and is_expert_layer(layer):
                    prepare_experts(layer)
                return result

            method.process_weights_after_loading = process  # an instance attribute shadows the method
            self._wrapped.append(method)
        return self

    def __exit__(self, *exc) -> None:
        for method in self._wrapped:
            del method.process_weights_after_loading
        self._wrapped.clear()

    def _emptied(self) -> set[str]:
        return {checkpoint_name(f"{name}.{pname}") for name, m in self.modules.items()
                for pname, p in m.named_parameters(recurse=False) if p.numel() == 0}

    def first_load_done(self) -> "ProcessingCapture":
        """After a first load's processing: keeps the fingerprints of the parameters it packed away (and of
        the routed experts' tensors), as a reload's capture holds them."""
        params = {checkpoint_name(f"{name}.{pname}") for name, m in self.modules.items()
                  for pname, _ in m.named_parameters(recurse=False)}
        self.packed, self.first_load = self._emptied(), False
        self.fingerprints = {k: v for k, v in self.fingerprints.items() if k in self.packed or k not in params}
        return self


def as_model_dtype(param: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """``param`` in the model's dtype where it is a float32 copy whose values that dtype holds exactly (the
    kernel reads the values the trainer predicts in the model's dtype), else ``param`` unchanged: a
    float32 value the model's dtype cannot hold differs from the prediction and is reported. The exactness
    test reads one bool from the device, only for such float32 parameters of a lower-precision model."""
    if param.dtype != torch.float32 or model_dtype == torch.float32 or not model_dtype.is_floating_point:
        return param
    narrow = param.to(model_dtype)
    return narrow if torch.equal(narrow.to(torch.float32), param) else param


def parameter_report(model: torch.nn.Module, capture: ProcessingCapture | None, model_dtype: torch.dtype) -> dict:
    """``{"parameters": {name: [a, b]}, "processed": {name: [a, b]}, "aliases": {name: canonical},
    "problems": [...], "seconds": fingerprinting time}`` of the model after a reload (module docstring);
    ``model_dtype`` is the dtype the engine was built in."""
    start = time.perf_counter()
    held, aliases, owner = {}, {}, {}
    for name, param in model.named_parameters(remove_duplicate=False):
        name = checkpoint_name(name)
        if id(param) in owner:
            aliases[name] = owner[id(param)]
            continue
        owner[id(param)] = name
        if capture is not None and name in capture.covered:  # reported through its HF parts
            continue
        if param.numel() > 0:  # an emptied parameter was packed: see the capture
            held[name] = as_model_dtype(param.detach(), model_dtype)
    parameters = dict(zip(held, fingerprint_many([(tensor, 0) for tensor in held.values()])))
    processed = capture.fingerprints if capture is not None else {}
    problems = unprocessed_problems(capture) if capture is not None else []
    host = to_host({**{("parameters", n): v for n, v in parameters.items()},
                    **{("processed", n): v for n, v in processed.items()}})  # one transfer for both
    report = {"parameters": {}, "processed": {}}
    for (kind, name), value in host.items():
        report[kind][name] = list(value)
    return {**report, "aliases": aliases, "problems": problems,
            "seconds": time.perf_counter() - start + (capture.seconds if capture is not None else 0.0)}


def unprocessed_problems(capture: ProcessingCapture) -> list[str]:
    return [f"engine layer {name} was not processed after this sync's load (its kernels may still use the "
            f"previous weights)" for name in capture.modules if name not in capture.processed]


def arrival_report(arrived: dict[str, torch.Tensor], capture: ProcessingCapture) -> dict:
    """The report of an engine that holds shards (TP > 1): the fingerprints of the full HF tensors its
    loader received, and its layers that were not processed after loading."""
    return {"parameters": {n: list(v) for n, v in to_host(arrived).items()}, "processed": {}, "aliases": {},
            "problems": unprocessed_problems(capture), "seconds": capture.seconds}


def adapter_report(lora_manager, lora_id: int) -> dict:
    """``{"adapters": {name: [a, b]}, "problems": [...], "seconds": ...}``: the fingerprints of the LoRA slot
    that holds adapter ``lora_id`` in every LoRA layer of the engine (``lora_manager``: vLLM's adapter
    manager), where its kernels read them. Names are ``<vLLM module>.lora_a.<slice>`` and ``.lora_b.<slice>``
    (a fused layer keeps one slice per HF projection: ``qkv_proj`` slices q, k, v)."""
    start = time.perf_counter()
    if lora_id not in lora_manager.lora_index_to_id:
        return {"adapters": {}, "problems": [f"the engine holds no active slot for LoRA adapter {lora_id}"],
                "seconds": time.perf_counter() - start}
    slot = lora_manager.lora_index_to_id.index(lora_id)
    prints = {}
    for module_name, module in lora_manager.modules.items():
        for part, stacked in (("lora_a", getattr(module, "lora_a_stacked", ())),
                              ("lora_b", getattr(module, "lora_b_stacked", ()))):
            for index, buffer in enumerate(stacked):
                prints[f"{module_name}.{part}.{index}"] = fingerprint(buffer[slot])
    return {"adapters": {n: list(v) for n, v in to_host(prints).items()}, "problems": [],
            "seconds": time.perf_counter() - start}


def fused_placement(hf_shapes: dict[str, tuple[int, ...]], fused: dict[str, list[str]]
                     ) -> dict[str, tuple[str, int]]:
    """Each HF tensor's place in the engine: ``hf_name -> (engine parameter, element offset)``. A part of
    a fused module (``fused``: e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``) sits after its
    preceding parts, concatenated along the first dimension; every other tensor is its own parameter."""
    part_of = {part: (name, index) for name, parts in fused.items() for index, part in enumerate(parts)}
    placement = {}
    for name in hf_shapes:
        path = name.split(".")
        if len(path) < 2 or path[-2] not in part_of:
            placement[name] = (name, 0)
            continue
        fused_name, index = part_of[path[-2]]
        before = [".".join(path[:-2] + [part, path[-1]]) for part in fused[fused_name][:index]]
        missing = [b for b in before if b not in hf_shapes]
        if missing:
            raise ValueError(f"weight sync: the engine fuses {fused[fused_name]} into {fused_name}, but the "
                             f"checkpoint has {name} without {missing}")
        offset = sum(math.prod(hf_shapes[b]) for b in before)
        placement[name] = (".".join(path[:-2] + [fused_name, path[-1]]), offset)
    return placement
