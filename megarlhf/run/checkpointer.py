"""Run-state checkpoints of the trainers: save every k steps, keep the newest few, resume exactly.

A run checkpoint is ``<checkpoint dir>/step_<N>/``, one :func:`megarlhf.checkpoint.distributed.save_checkpoint`
(atomic: written under a temporary name, completion marker, rename) holding

* the actor's weights under the model-checkpoint key layout (so ``load_checkpoint``, the HF export and
  evaluation read a run checkpoint like a model checkpoint), its Megatron optimizer state
  (``fully_reshardable`` for the distributed optimizer: it reshards across TP/PP/DP) and its lr scheduler;
* the other trainable models (the PPO critic) as companions, the same three things each; the frozen
  reference is never saved (it is the initial model, rebuilt from ``model.path``);
* the driver's ``extra_state`` (step, sampler state, metric counters, ...; the same on every rank);
* every rank's RNG states (Python, NumPy, torch, CUDA when present, and Megatron's model-parallel RNG
  tracker) in ``rank_state/rank<r>.pt``.

Resuming at another world size. Weights and optimizer state reshard, RNG streams do not (rank r's stream
has no counterpart when the ranks change). Refusing such a resume would make the resharding useless, and
a run on another layout cannot be bit-identical to the original anyway (reduction orders change), so the
checkpointer then re-seeds every rank from ``(seed, step)`` exactly as start-up does and logs a warning
(Megatron-LM likewise skips RNG state when the layout changes). At the same world size the streams are
restored exactly.
"""
from __future__ import annotations

import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megarlhf.checkpoint.async_save import AsyncCheckpointWriter
from megarlhf.checkpoint.distributed import (CheckpointError, Companion, TrainingState, checkpoint_metadata,
                                             is_complete_checkpoint, load_checkpoint, load_rank_state, save_checkpoint)
from megarlhf.config.schema import RunConfig
from megarlhf.core.seeds import RESUME_RESEED_STRIDE
from megarlhf.learner.models import TrainModel

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step_(\d+)")
MAIN_ROLE = "actor"


def capture_rng_state() -> dict:
    """This rank's RNG states, as tensors, numbers, strings and tuples only (loadable with weights_only)."""
    from megatron.core import tensor_parallel

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    cached),
             "torch": torch.get_rng_state(),
             "megatron": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state`."""
    from megatron.core import tensor_parallel

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["megatron"]:
        tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["megatron"].items()})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (file-system views may differ between nodes)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value if _rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


class RunCheckpointer:
    """Saves and resumes the whole state of a run (see the module docstring)."""

    def __init__(self, config: RunConfig, models: dict[str, TrainModel], kind: str | None = None):
        """``kind``: the command whose state this is (``sft``, ``dpo``, ...): saved with every checkpoint, and
        a checkpoint of another kind is refused on resume (None: any kind, e.g. for ``megarlhf export``)."""
        if MAIN_ROLE not in models:
            raise ValueError(f"RunCheckpointer: models must include {MAIN_ROLE!r}, got {sorted(models)}")
        frozen = [role for role, m in models.items() if not m.trainable]
        if frozen:
            raise ValueError(f"RunCheckpointer: {frozen} have no optimizer; pass only trainable models (the frozen "
                             "reference is rebuilt from model.path, never checkpointed)")
        self.config = config
        self.kind = kind
        self.models = dict(models)
        self.directory = Path(config.checkpoint.dir or Path(config.logging.run_dir) / "checkpoints").absolute()
        self.writer: AsyncCheckpointWriter | None = None  # made by the first save with checkpoint.async_save

    def _companions(self) -> dict[str, Companion]:
        return {role: Companion(m.model, m.optimizer, m.scheduler) for role, m in self.models.items()
                if role != MAIN_ROLE}

    def complete_checkpoints(self) -> list[Path]:
        """The complete ``step_<N>`` checkpoints in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if step_of(p) is not None and is_complete_checkpoint(p)]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        found = self.complete_checkpoints()
        return found[-1] if found else None

    def _resume_path(self) -> Path | None:
        choice = self.config.checkpoint.resume
        if choice == "none":
            return None
        if choice == "auto":
            return self.latest()
        path = Path(choice).absolute()
        checkpoint_metadata(path)  # a clear error when it is missing, incomplete or not a checkpoint
        return path

    def _check_kind(self, path: Path) -> None:
        saved = checkpoint_metadata(path)["metadata"].get("kind")  # None: saved before kinds were recorded
        if self.kind is not None and saved is not None and saved != self.kind:
            raise CheckpointError(f"{path} holds the state of a `megarlhf {saved}` run and this is a `megarlhf "
                                  f"{self.kind}` run, which resumes only its own: choose another logging.run_dir "
                                  "(or checkpoint.dir), or start from that run's export (model.path=<its run_dir>/hf)")

    def resume(self) -> dict | None:
        """Loads the checkpoint that ``checkpoint.resume`` names into the models (weights, optimizer state,
        lr schedule) and this rank's RNG streams; returns the saved ``extra_state`` (None: nothing to
        resume). Collective."""
        try:
            found = self._resume_path() if _rank() == 0 else None
            if found is not None:
                self._check_kind(found)
            error = None
        except CheckpointError as err:
            found, error = None, f"checkpoint.resume={self.config.checkpoint.resume!r}: {err}"
        found, error = _from_rank0((found, error))
        if error:
            raise CheckpointError(error)
        if found is None:
            return None
        actor = self.models[MAIN_ROLE]
        extra = load_checkpoint(found, actor.model,
                                training=TrainingState(actor.optimizer, actor.scheduler, self._companions()))
        saved_world = checkpoint_metadata(found)["saved_with"]["world_size"]
        if saved_world == dist.get_world_size():
            restore_rng_state(load_rank_state(found))
        else:
            from parallel.runtime import seed_everything

            step = step_of(found) or 0
            logger.warning("resuming %s (saved by %d ranks) on %d ranks: weights and optimizer state are "
                           "resharded; RNG streams cannot be, every rank is re-seeded from (seed=%d, step=%d)",
                           found, saved_world, dist.get_world_size(), self.config.seed, step)
            seed_everything(self.config.seed + RESUME_RESEED_STRIDE * step)
        return extra

    def should_save(self, completed_steps: int, total_steps: int) -> bool:
        """After every ``checkpoint.every`` completed steps (0: never in between) and after the last one."""
        every = self.config.checkpoint.every
        return completed_steps == total_steps or (every > 0 and completed_steps % every == 0)

    def save(self, step: int, extra_state: dict) -> Path:
        """Writes ``step_<step>`` atomically (replacing one of that name), then keeps only the newest
        ``checkpoint.keep_last`` complete checkpoints. Collective; returns the checkpoint's path.

        With ``checkpoint.async_save`` the state is captured now and written in the background; the
        checkpoint appears (and older ones are pruned) when :meth:`poll` or :meth:`close` publishes it.
        A save still in flight is waited for first: one background write at a time bounds host memory."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"RunCheckpointer.save: step must be an int >= 0, got {step!r}")
        if self.writer is not None:
            self._after_publish(self.writer.wait())
        elif self.config.checkpoint.async_save:
            self.writer = AsyncCheckpointWriter()
        actor = self.models[MAIN_ROLE]
        training = TrainingState(actor.optimizer, actor.scheduler, self._companions(), capture_rng_state(),
                                 self.config.checkpoint.optimizer_format)
        path = save_checkpoint(self.directory / f"step_{step}", actor.model, extra_state, overwrite=True,
                               metadata={"step": step, "models": sorted(self.models),
                                         **({"kind": self.kind} if self.kind is not None else {})},
                               training=training,
                               writer=self.writer)
        if not self.config.checkpoint.async_save:
            self._after_publish([path])
        return path

    def poll(self) -> None:
        """Publishes a background save whose write has finished (nothing without ``checkpoint.async_save``).
        Collective: the trainers call it at the start of every step."""
        if self.writer is not None:
            self._after_publish(self.writer.poll())

    def close(self) -> None:
        """Waits for and publishes the background save in flight, if any, and stops the writer (a later save
        starts another). Collective: the end of a run."""
        if self.writer is not None:
            writer, self.writer = self.writer, None
            self._after_publish(writer.close())

    def _after_publish(self, published: list[Path]) -> None:
        if not published:
            return
        if _rank() == 0:
            self._prune(published[-1])
        if dist.get_world_size() > 1:
            dist.barrier()

    def _prune(self, newest: Path) -> None:
        """Deletes complete checkpoints beyond ``keep_last`` and partial saves left by killed runs (saves
        are sequential and this runs when none is in flight, so any temporary directory is dead)."""
        keep = self.config.checkpoint.keep_last
        complete = self.complete_checkpoints()
        if keep is not None:
            for old in complete[:-keep]:
                if old != newest:
                    shutil.rmtree(old)
        for partial in self.directory.glob("step_*.tmp-*"):
            shutil.rmtree(partial, ignore_errors=True)
