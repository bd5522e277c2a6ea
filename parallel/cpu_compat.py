"""The CPU compatibility layer for Megatron-Core: the one place where megarlhf bends CUDA assumptions.

Megatron-Core 0.19.2 assumes a GPU in a few dozen places (hard-coded ``device="cuda"``,
``torch.cuda.current_device()``, ``tensor.cuda()``, ``torch.cuda.synchronize()``, CUDA streams and
events, the CUDA RNG tracker, ``param.type() == 'torch.cuda.FloatTensor'`` checks). Stubbing
``torch.cuda`` alone is not enough: the first CUDA tensor factory then fails with "Cannot access
accelerator device when none is available". :func:`activate` therefore applies the patches below,
and only when CUDA is absent; on a GPU machine it does nothing and Megatron runs unmodified.

Patches (every one of them, and why):

1. ``_CudaToCpu``, a process-wide ``TorchFunctionMode`` that
   a. rewrites any ``device=`` keyword that names CUDA (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``
      or a bare int, which is what ``torch.cuda.current_device()`` returns) to ``"cpu"``, and drops
      ``pin_memory=True`` (pinning needs an accelerator);
   b. rewrites CUDA device arguments of ``Tensor.to`` to ``"cpu"``;
   c. makes ``Tensor.cuda()`` and ``Tensor.pin_memory()`` return the tensor itself;
   d. reports ``torch.cuda.<X>Tensor`` from ``Tensor.type()`` so the optimizers' dtype checks
      (``param.type() == 'torch.cuda.FloatTensor'``) accept CPU parameters.
2. No-op or CPU stand-ins for ``torch.cuda`` calls that otherwise raise without a GPU:
   ``current_device`` (0), ``set_device``, ``synchronize``, ``Stream``/``current_stream``/
   ``default_stream``/``stream``, ``Event``, ``is_current_stream_capturing`` (False), the memory
   statistics (0), ``nvtx.range_push``/``range_pop``.
3. The "CUDA" RNG is the CPU default generator: ``torch.cuda.manual_seed``/``get_rng_state``/
   ``set_rng_state`` and Megatron's ``_set_cuda_rng_state`` act on it. This keeps Megatron's RNG
   tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``) working with the
   same semantics as on GPU: a tensor-parallel-region dropout draws from the TP-rank-specific stream.
   Megatron's warning "CPU RNG state changed within GPU RNG context" is therefore expected (the two
   are the same generator) and is filtered out.
4. :func:`transformer_config_overrides` gives the ``TransformerConfig`` settings CPU needs:
   ``use_cpu_initialization`` (no CUDA init path), every fused kernel off (they are CUDA/TE/apex
   kernels), ``persist_layer_norm=False`` and ``batch_p2p_comm=False`` (gloo has no batched P2P), and
   ``deallocate_pipeline_outputs=True``: Megatron's schedules then run backward through its
   ``custom_backward`` (the autograd engine called directly) rather than ``torch.autograd.backward``,
   which is a torch function: patch 1's mode is popped while it handles one, so the backward of
   Megatron's autograd Functions would run without it (the MoE dispatcher's all-to-all allocates with
   ``device=torch.cuda.current_device()`` in its backward).
   Code that builds a TransformerConfig merges it in; on GPU it is empty.

5. The MoE alltoall token dispatcher moves its split sizes to the host with Megatron's
   ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA tensors; a CPU tensor would
   stay a tensor, which ``all_to_all_single`` (gloo) refuses as split sizes. The dispatcher's copy of that
   function also makes host tensors numpy arrays when asked (:func:`_patch_moe_dispatcher`).

6. Gathers and reduce-scatters over the first dimension (sequence parallelism): Megatron's
   ``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` allocate their output with
   ``device=torch.cuda.current_device()``, which patch 1 cannot rewrite inside a recomputing backward
   (Megatron's ``CheckpointFunction.backward`` calls ``torch.autograd.backward``, a torch function during
   which the mode is popped); and the alltoall dispatcher gathers each TP rank's (differently many) routed
   tokens with ``output_split_sizes`` and scatters their gradients back with ``input_split_sizes``, i.e.
   ``all_gather`` / ``reduce_scatter`` of unequal tensors, which gloo refuses. Both functions are replaced
   (:func:`_patch_first_dim_collectives`): outputs on the input's device; uneven parts as an equal-size
   all-gather of zero-padded parts and as an all-reduce followed by this rank's slice.

7. Megatron's activation checkpointing (``tensor_parallel.random.CheckpointFunction``) runs the recomputed
   chunk's backward with ``torch.autograd.backward``, a torch function, so patch 1's mode is popped inside
   it and a CUDA allocation there fails (the sequence-parallel linears' reduce-scatter buffer). That module
   sees a ``torch`` whose ``autograd.backward`` calls the autograd engine directly, as Megatron's own
   ``custom_backward`` does (:func:`_patch_checkpoint_backward`); everything else is torch's.

8. Megatron's fusions (``megatron.core.jit.jit_fuser``) are ``torch.compile`` on torch >= 2.2, applied as
   decorators when their modules are imported, as is ``InferenceTopKRouter._forward`` (imported by the pipeline
   schedules): the first such call imports dynamo and inductor's compiler, 1.6 s of every process's 3.3 s
   Megatron import (2 s of CPU; torch's optimizers import dynamo later anyway, inductor's 0.8 s they do not),
   for kernels patch 4 turns off (and that inductor would build with a C++ compiler if one ran here).
   :func:`install_import_patches` (called by ``parallel/__init__``, before anything imports Megatron: a
   :class:`~parallel.megatron_import.ImportHook`) makes ``torch.compile`` the identity while the
   ``megatron.core`` package loads, then switches Megatron's fuser
   off (its own ``disable_jit_fuser``) for the modules loaded later: those functions stay eager Python.

(Packed-sequence RoPE without Megatron's per-sequence loop is not a CPU matter: it lives in
:mod:`parallel.megatron_fallbacks`, on every device; nor are the torch norms under sequence parallelism:
:mod:`parallel.sequence_parallel`.)

Not patched, because it cannot work here: context parallelism in Megatron's local attention (megarlhf
has its own CP attention in :mod:`parallel.context_parallel`).
"""
from __future__ import annotations

import contextlib
import logging
import sys

import torch
from torch.overrides import TorchFunctionMode

from parallel.megatron_import import ImportHook

_MODE: "_CudaToCpu | None" = None


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made while it is active (patch 1)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream / Event on CPU: every operation completes immediately."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0


class _RngMessageFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_torch_cuda() -> None:
    """Patches 2 and 3 on the torch.cuda side."""
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.is_current_stream_capturing = lambda: False
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, stat, lambda device=None: 0)
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.nvtx.range_push = lambda msg: None
    cuda.nvtx.range_pop = lambda: None
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)


def _patch_megatron_rng() -> None:
    """Patch 3 on the Megatron side: its private CUDA-RNG setter acts on the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    def set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._set_cuda_rng_state = set_rng_state
    logging.getLogger(mrandom.__name__).addFilter(_RngMessageFilter())


def _patch_moe_dispatcher() -> None:
    """Patch 5: the dispatcher's host copies of its split sizes are numpy arrays on CPU as on GPU."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        tensor = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host


def _patch_first_dim_collectives() -> None:
    """Patch 6: first-dimension gathers and reduce-scatters on the input's device, uneven ones over gloo
    (module docstring)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        size = group.size()
        if size == 1:
            return input_
        if output_split_sizes is None:
            output = input_.new_empty((input_.shape[0] * size, *input_.shape[1:]))
            dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
            return output
        widest = max(output_split_sizes)
        padded = input_.new_zeros((widest, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)])

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        size = group.size()
        if size == 1:
            return input_
        if input_split_sizes is None:
            if input_.shape[0] % size:
                raise ValueError(f"reduce-scatter: first dimension {input_.shape[0]} is not divisible by the group "
                                 f"size {size}")
            output = input_.new_empty((input_.shape[0] // size, *input_.shape[1:]))
            dist.reduce_scatter_tensor(output, input_.contiguous(), group=group)
            return output
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(input_split_sizes[:group.rank()])
        return total[start:start + input_split_sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


def _engine_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    """``torch.autograd.backward`` for tensors with explicit gradients, through the autograd engine (not a
    torch function, so patch 1's mode stays active inside)."""
    from torch.autograd.variable import Variable

    tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
    grads = (grad_tensors,) if torch.is_tensor(grad_tensors) else tuple(grad_tensors)
    grads = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads))
    Variable._execution_engine.run_backward(
        tensors=tensors, grad_tensors=grads, keep_graph=bool(retain_graph or create_graph),
        create_graph=create_graph, inputs=tuple(inputs or ()), allow_unreachable=True, accumulate_grad=True)


class _AutogradWithEngineBackward:
    """``torch.autograd`` as :mod:`megatron.core.tensor_parallel.random` sees it under patch 7."""

    backward = staticmethod(_engine_backward)

    def __getattr__(self, name):
        return getattr(torch.autograd, name)


class _TorchForCheckpointing:
    """``torch`` as :mod:`megatron.core.tensor_parallel.random` sees it under patch 7."""

    autograd = _AutogradWithEngineBackward()

    def __getattr__(self, name):
        return getattr(torch, name)


def _patch_checkpoint_backward() -> None:
    """Patch 7 (module docstring)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.torch = _TorchForCheckpointing()


def _identity_compile(model=None, **options):
    """``torch.compile`` that compiles nothing: the function itself, also as a decorator factory (patch 8)."""
    return model if model is not None else (lambda function: function)


@contextlib.contextmanager
def _eager_megatron():
    """While ``megatron.core`` loads, ``torch.compile`` is the identity; then Megatron's fuser is off (patch 8)."""
    compile_ = torch.compile
    torch.compile = _identity_compile
    try:
        yield
    finally:
        torch.compile = compile_
    jit = sys.modules.get("megatron.core.jit")
    if jit is not None:
        jit.disable_jit_fuser()


def install_import_patches() -> None:
    """Patch 8 (module docstring), before Megatron is imported; nothing when CUDA is available or Megatron is
    loaded already."""
    if not torch.cuda.is_available():
        ImportHook.install("megatron.core", _eager_megatron)


def is_active() -> bool:
    return _MODE is not None


def activate() -> bool:
    """Applies every patch listed in the module docstring, once. Returns whether the layer is active.

    Does nothing (and returns False) when CUDA is available.
    """
    global _MODE
    if torch.cuda.is_available():
        return False
    if _MODE is None:
        _patch_torch_cuda()
        _patch_megatron_rng()
        _patch_moe_dispatcher()
        _patch_first_dim_collectives()
        _patch_checkpoint_backward()
        _MODE = _CudaToCpu()
        _MODE.__enter__()
    return True


def transformer_config_overrides() -> dict:
    """Patch 4: the TransformerConfig kwargs CPU needs; empty when CUDA is available."""
    if torch.cuda.is_available():
        return {}
    return {
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "batch_p2p_comm": False,
        "deallocate_pipeline_outputs": True,
    }
