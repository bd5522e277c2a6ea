"""Checkpoints written in the background while training goes on (``checkpoint.async_save``).

A save is split the way Megatron-Core splits it (``dist_checkpointing.save(..., async_sharded_save=True)``):

1. *now*, on the training thread: the sharded state dict is planned and its tensors are staged into host
   memory (a device-to-host copy on a GPU); the caller may change the model as soon as this returns;
2. *in the background*: a forked process writes the staged tensors into the checkpoint's temporary
   directory (a fork also gives CPU tensors copy-on-write snapshot semantics, so an optimizer step taken
   meanwhile does not reach the files);
3. *at finalisation*, once the write has finished on every rank: Megatron's own metadata, then the
   caller's ``publish`` (megarlhf's completion marker and the atomic rename,
   :mod:`megarlhf.checkpoint.distributed`). Until then the checkpoint exists only under its temporary
   name, so a crash during the background write leaves the previous checkpoint as it was.

Finalisation is collective: every rank calls :meth:`AsyncCheckpointWriter.poll` (non-blocking, once per
step) and :meth:`AsyncCheckpointWriter.wait` (blocking) at the same points.

Which writer. megatron-core 0.19 deprecates its built-in async writer ("mcore") in favour of NVRx
(nvidia-resiliency-ext >= 0.6.0, Megatron's ``NVRX_MIN_VERSION``). The NVRx writer is used when Megatron
finds it importable; otherwise the built-in one, with one warning saying so. Both hand out the same
request/queue interface (``AsyncCallsQueue.schedule_async_request`` / ``maybe_finalize_async_calls``), so
this module does not branch on them beyond choosing. Note that installing an older NVRx (the newest on
some package indexes is 0.4.1) breaks ``megatron.core.dist_checkpointing`` at import time in
megatron-core 0.19.2 (its version check reads ``nvidia_resiliency_ext.__version__``, which 0.4.1 lacks).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from megarlhf.core.errors import CheckpointError

logger = logging.getLogger(__name__)
_warned_builtin = False


def async_strategy() -> str:
    """"nvrx" when Megatron can use nvidia-resiliency-ext's async writer, otherwise its built-in "mcore"."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    return "nvrx" if torch_strategy.HAVE_NVRX else "mcore"


class AsyncCheckpointWriter:
    """Schedules background checkpoint writes and publishes each once every rank has written its part."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

        global _warned_builtin
        self.strategy = async_strategy()
        if self.strategy == "mcore" and not _warned_builtin:
            logger.warning("checkpoint.async_save: nvidia-resiliency-ext >= 0.6.0 is not installed, so checkpoints "
                           "are written by Megatron-Core's built-in async writer (deprecated by megatron-core in "
                           "favour of NVRx; the files and the atomic publish are the same)")
            _warned_builtin = True
        _, queue_class = get_async_strategy(self.strategy, "AsyncCallsQueue")
        # persistent=False: a process forked per save, which snapshots CPU tensors (see the module docstring)
        self._queue = queue_class(persistent=False)
        self._pending: dict[int, Path] = {}  # call index -> the checkpoint's final path

    def schedule(self, request: Any, final: Path, publish: Callable[[], None]) -> None:
        """Starts writing ``request`` (Megatron's AsyncRequest for the checkpoint at ``final``); ``publish``
        runs on every rank after Megatron's own finalisation. Collective."""
        request.add_finalize_fn(publish)
        call = self._queue.schedule_async_request(request)
        self._pending[call] = final

    @property
    def pending(self) -> list[Path]:
        """The checkpoints scheduled and not yet published, oldest first."""
        return [self._pending[call] for call in sorted(self._pending)]

    def poll(self) -> list[Path]:
        """Publishes the saves whose background write has finished on every rank; returns their paths
        (oldest first). Collective, does not wait for writes still in progress."""
        return self._finalize(blocking=False)

    def wait(self) -> list[Path]:
        """Waits for every scheduled save and publishes it; returns their paths (oldest first). Collective."""
        return self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> list[Path]:
        if not self._pending:
            return []
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except (Exception, CheckpointException) as err:  # torch's write failures derive from BaseException
            failed = self.pending
            self._pending.clear()
            raise CheckpointError(f"the background save of checkpoint {failed[0]} failed while writing or publishing "
                                  f"it ({type(err).__name__}: {err}); the previous checkpoints are unchanged") from err
        return [self._pending.pop(call) for call in sorted(done)]

    def close(self) -> list[Path]:
        """Waits for and publishes every scheduled save, then stops the writer; returns their paths. Collective."""
        try:
            return self.wait()
        finally:
            self._queue.close()
