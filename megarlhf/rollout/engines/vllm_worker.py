"""What the vLLM engine runs inside vLLM's worker (through ``collective_rpc``): in-place reloads and the
fingerprint reports of what the model then computes with.

The worker is this process for an in-process engine and vLLM's engine-core child process otherwise, so
every function here takes the worker and plain data (or a handle to shared memory) and returns plain data.
On CPU vLLM repacks linear weights after loading: writing parameters directly has no effect, so every
load goes through vLLM's own reload path (``reload_weights``, or its layerwise reload session).
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from megarlhf.rollout.engines.fingerprint import fingerprint
from megarlhf.rollout.engines.shared_tensor import open_shared
from megarlhf.rollout.engines.weights import (ExpectedReloadNotices, ProcessingCapture, adapter_report,
                                              arrival_report, expert_placement, fused_parameters, parameter_report,
                                              reprocess_tied, tied_modules)


def reload_and_report(worker, weights: Iterable[tuple[str, torch.Tensor]], sharded: bool) -> dict:
    """Reloads the model's weights in place from ``weights`` and returns the fingerprints of the parameters
    it now computes with (of the tensors received, for a sharded engine)."""
    model = worker.model_runner.model
    tied, arrived = tied_modules(model), {}

    def arriving():
        for name, tensor in weights:
            if sharded:
                arrived[name] = fingerprint(tensor)
            yield name, tensor

    with ProcessingCapture(model) as capture, ExpectedReloadNotices(model):
        worker.reload_weights(weights_iterator=arriving())
        reprocess_tied(tied)
    if sharded:
        return arrival_report(arrived, capture)
    return parameter_report(model, capture, worker.model_runner.model_config.dtype)


def reload_checkpoint_and_report(worker, sharded: bool) -> dict:
    """:func:`reload_and_report` of the engine's own checkpoint, read from disk by vLLM's model loader.

    Floating tensors are cast to the engine's dtype first, as its first load did by loading into
    parameters of that dtype: a parameter that processing after that load widened to float32 (vLLM's AMX
    path upcasts the bias of small GEMMs) would otherwise take a float32 checkpoint's values unrounded."""
    from vllm.model_executor.model_loader import get_model_loader

    runner = worker.model_runner
    dtype = runner.vllm_config.model_config.dtype
    loader = get_model_loader(runner.vllm_config.load_config)
    weights = ((name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
               for name, tensor in loader.get_all_weights(runner.vllm_config.model_config, runner.get_model()))
    return reload_and_report(worker, weights, sharded)


FIRST_LOAD_REPORT = "megarlhf_first_load_report"  # where the model keeps its first load's report


@contextlib.contextmanager
def first_load_reported():
    """While active (around building an engine whose worker runs in this process), vLLM's first load of its
    checkpoint is fingerprinted as it is processed, and the report (what :func:`reload_checkpoint_and_report`
    would report after reloading the same checkpoint) is kept on the model for :func:`take_first_load_report`.
    Calibration's bitwise check then needs no second read and load of the checkpoint (1.3 s of SmolLM2's
    start-up on CPU). Wraps vLLM's ``base_loader.process_weights_after_loading`` (0.32), the step of its
    model loader that turns loaded weights into the kernels' form."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading

    def process(model, model_config, target_device):
        with ProcessingCapture(model, first_load=True) as capture:
            original(model, model_config, target_device)
        setattr(model, FIRST_LOAD_REPORT, parameter_report(model, capture.first_load_done(), model_config.dtype))

    base_loader.process_weights_after_loading = process
    try:
        yield
    finally:
        base_loader.process_weights_after_loading = original


def take_first_load_report(worker) -> dict | None:
    """The report :func:`first_load_reported` kept (None without one), once."""
    model = worker.model_runner.model
    report = getattr(model, FIRST_LOAD_REPORT, None)
    if report is not None:
        delattr(model, FIRST_LOAD_REPORT)
    return report


def begin_session(worker) -> None:
    """Opens a layerwise reload session: the buckets that follow are loaded in place, processed at the end."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    model = worker.model_runner.model
    worker.megarlhf_tied_modules = tied_modules(model)  # before the layerwise reload moves params to meta
    worker.megarlhf_capture = ProcessingCapture(model).__enter__()
    worker.megarlhf_notices = ExpectedReloadNotices(model).__enter__()
    initialize_layerwise_reload(model)


def load_tensors(worker, tensors: list[tuple[str, torch.Tensor]]) -> None:
    worker.model_runner.model.load_weights(tensors)


def load_shared(worker, meta: list[tuple], handle: bytes) -> None:
    """Loads one bucket from the sender's buffer, reached through a handle to shared memory (not copied)."""
    from megarlhf.rollout.engines.api import WeightBucket

    payload = open_shared(handle)
    load_tensors(worker, WeightBucket(meta, payload).tensors())
    if payload.is_cuda:  # the sender reuses the memory once this call returns
        torch.cuda.synchronize()


def finish_session(worker) -> dict:
    """Ends the session; returns the fingerprints of the parameters the engine now computes with."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model, capture = worker.model_runner.model, worker.megarlhf_capture
    try:
        finalize_layerwise_reload(model, worker.model_runner.model_config)
        reprocess_tied(worker.megarlhf_tied_modules)  # vLLM skips tied heads: see weights.tied_modules
    finally:
        capture.__exit__(None, None, None)
        worker.megarlhf_notices.__exit__(None, None, None)
    return parameter_report(model, capture, worker.model_runner.model_config.dtype)


def layout(worker) -> tuple[dict[str, list[str]], dict[str, tuple[str, int]]]:
    """The model's fused modules and the placement of its stacked experts."""
    model = worker.model_runner.model
    return fused_parameters(model), expert_placement(model)


def lora_slot_report(worker, lora_id: int) -> dict:
    return adapter_report(worker.model_runner.lora_manager._adapter_manager, lora_id)
