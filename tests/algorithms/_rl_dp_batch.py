"""The global batch of the 2-rank data-parallel test, built identically by the worker and the test.

Rank 0 holds two micro-batches and rank 1 one, with unequal token and sequence counts. Padding holds
garbage (large features, NaN values) so that any read of it shows up; the features' padding is finite
because the test differentiates through x @ theta, whose backward multiplies every feature by its
(zero) gradient.
"""
from __future__ import annotations

import torch

# (rows, response lengths) of each micro-batch; rank 0 has 2 micro-batches, rank 1 has 1.
LAYOUT = {0: [[5, 1, 3], [6, 2]], 1: [[4, 4, 6, 1]]}
LENGTH = 6  # padded response length T
FEATURES = 3


def _mask(lengths: list[int]) -> torch.Tensor:
    return torch.arange(LENGTH)[None, :] < torch.tensor(lengths)[:, None]


def micro_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches: features x [B, T, F], mask [B, T], rewards [B], values [B, T]."""
    out = []
    generator = torch.Generator().manual_seed(1234)
    for r in sorted(LAYOUT):
        for lengths in LAYOUT[r]:
            mask = _mask(lengths)
            x = torch.randn(len(lengths), LENGTH, FEATURES, generator=generator, dtype=torch.float64)
            x = torch.where(mask[:, :, None], x, torch.full_like(x, 1e3))
            rewards = torch.randn(len(lengths), generator=generator, dtype=torch.float64)
            values = torch.randn(len(lengths), LENGTH, generator=generator, dtype=torch.float64)
            values = torch.where(mask, values, torch.full_like(values, float("nan")))
            if r == rank:
                out.append({"x": x, "mask": mask, "rewards": rewards, "values": values})
    return out


def initial_theta() -> torch.Tensor:
    return torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64)


def per_token_loss(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A smooth, non-linear per-token loss of the shared parameter (huge in padding)."""
    z = x @ theta
    return torch.tanh(z) + 0.5 * z ** 2
