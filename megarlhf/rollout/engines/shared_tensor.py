"""A tensor handed to another process of the same machine without copying its bytes.

The disaggregated placement's engine rank receives each weight bucket into one flat buffer and must pass
it to vLLM's engine core, a child process reached through vLLM's RPC. Pickling the bytes would copy
every bucket twice through a socket. Instead :func:`share` sends a *handle*, made by torch's
multiprocessing reductions (``torch.multiprocessing.reductions.reduce_tensor``, pickled with
``ForkingPickler`` so that storages are shared rather than serialised):

* on CPU the buffer lives in shared memory and the handle passes its file descriptor (Python's
  ``multiprocessing`` resource sharer: the receiving process must descend from the sender with the same
  authentication key, as vLLM's spawned engine core does);
* on a GPU the handle is a CUDA IPC handle of the buffer's memory, with an event the receiver waits on
  before reading (so the broadcast that filled the buffer has finished).

:func:`open_shared` rebuilds the tensor in the receiving process, on its current CUDA device: a process
that sees only its own GPU numbers it 0 whatever the sender called it. The sender keeps the buffer alive
until the receiver is done with it (vLLM's RPC returns after the load).
"""
from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_CUDA_DEVICE_ARG = 6  # the position of the storage's device index in rebuild_cuda_tensor's arguments


def shared_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised uint8 buffer that :func:`share` can hand over (in shared memory on CPU)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer.share_memory_() if buffer.device.type == "cpu" else buffer


def share(buffer: torch.Tensor) -> bytes:
    """The handle of ``buffer`` (from :func:`shared_buffer`) for :func:`open_shared` in another process."""
    if buffer.device.type == "cpu" and not buffer.is_shared():
        raise ValueError("share: a CPU buffer must live in shared memory (make it with shared_buffer)")
    return bytes(ForkingPickler.dumps(reduce_tensor(buffer)))


def open_shared(handle: bytes) -> torch.Tensor:
    """The tensor behind a :func:`share` handle (the same memory, no copy)."""
    rebuild, args = pickle.loads(handle)
    if rebuild is rebuild_cuda_tensor:
        args = (*args[:_CUDA_DEVICE_ARG], torch.cuda.current_device(), *args[_CUDA_DEVICE_ARG + 1:])
    return rebuild(*args)
