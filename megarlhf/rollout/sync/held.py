"""What the engines hold: a sync of weights they already hold is skipped.

The engines are proven to hold exactly what a sync of the actor would send at two moments: after the
calibration's bit-for-bit check of their own load of ``model.path`` against the trainer's conversion
(:mod:`megarlhf.rollout.sync.calibration`; a run without LoRA adapters, before anything was sent), and
after every verified sync (a sync that fails verification leaves them unknown: the next one sends). At
either moment each trainer rank fingerprints its own shards of the actor's parameters (its local tensors
on their device: no gather, no conversion; LoRA adapters included). Before the next sync it fingerprints
them again; when no trainer rank's changed (no optimizer step, no checkpoint loaded since: the first
rollout of a fresh run, an evaluation followed by the step's rollout, a skipped update), the sync would
send the very bits the engines hold, verified: it is skipped. A level-1 sleep keeps an engine's weights
(:mod:`megarlhf.rollout.colocate`), as the rounds that generate with ``sync_weights=False`` already rely
on. An engine whose weights are lost (a restarted one) needs :meth:`HeldWeights.forget`.

:attr:`HeldWeights.own_load` says whether the engines still hold their own load of ``model.path``
(nothing sent since the checkpoint check): samples drawn then are the calibration's natural samples,
which is how the step-0 gate measures the natural floor itself
(:func:`megarlhf.rollout.sync.calibration.step0_problems`) instead of calibration sampling prompts of its own.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from megarlhf.rollout.engines.fingerprint import fingerprint_many


class HeldWeights:
    """This trainer rank's record of the actor weights the engines were last proven to hold."""

    def __init__(self, model: torch.nn.Module, runtime):
        self.model, self.runtime = model, runtime
        self.prints: torch.Tensor | None = None  # None: the engines hold nothing known (a sync must send)
        self.own_load = False

    def current(self) -> torch.Tensor:
        """Fingerprints of this rank's actor parameters (int32 [n, 2], on their device; nothing is read)."""
        return torch.stack(fingerprint_many([(p.detach(), 0) for p in self.model.parameters()]))

    def checkpoint_verified(self) -> None:
        """The engines' own load of ``model.path`` equals what a sync would send, bit for bit."""
        self.prints, self.own_load = self.current(), True

    def forget(self) -> None:
        """The engines' weights are unknown (a sync began: until it is verified they may hold anything)."""
        self.prints, self.own_load = None, False

    def synced(self, prints: torch.Tensor) -> None:
        """A verified sync sent the weights whose fingerprints are ``prints`` (:meth:`current` before it)."""
        self.prints, self.own_load = prints, False

    def unchanged(self, prints: torch.Tensor) -> bool:
        """True on every trainer rank when no rank's parameters changed since the engines were proven to
        hold them. Collective over the trainer ranks (one read to the host)."""
        if self.prints is None or self.prints.shape != prints.shape:
            changed = torch.ones(1, dtype=torch.float64, device=prints.device)
        else:
            changed = (self.prints != prints).any().to(torch.float64).view(1)
        return self.runtime.all_reduce_on_device(changed, op="max", over="trainers").item() == 0  # host: verdict

    def resend(self, send: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Runs ``send`` even when the engines held the weights (an engine was replaced and lost them). When they
        held their own load of the checkpoint and no rank's parameters changed since, the verified send gives
        them those very bits again: :attr:`own_load` stays. Collective over the trainer ranks."""
        prints = self.current()
        own_load = self.own_load and self.unchanged(prints)
        self.forget()
        metrics = send()
        self.synced(prints)
        self.own_load = own_load
        return metrics

    def sync_unless_held(self, send: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Runs ``send`` (a sync that sends the actor's weights and verifies them) unless the engines hold them
        already; returns its metrics with ``weight_sync/skipped`` (1.0: nothing sent, ``time/weight_sync_s``
        the check's time). Collective over the trainer ranks."""
        start, prints = time.perf_counter(), self.current()
        if self.unchanged(prints):
            return {"weight_sync/skipped": 1.0, "time/weight_sync_s": time.perf_counter() - start}
        self.forget()
        metrics = send()
        self.synced(prints)
        return {**metrics, "weight_sync/skipped": 0.0}
