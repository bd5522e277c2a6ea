"""A resumable, seeded sampler of global batches, split across data-parallel ranks.

The sampler walks an endless stream of example indices: epoch ``e`` contributes a permutation of
``range(num_examples)`` drawn from ``numpy.random.default_rng([seed, e])`` (or the identity without
shuffling), and the epochs are concatenated. Global batch ``k`` is stream positions
``[k * B, (k + 1) * B)``, so a batch may straddle an epoch boundary and every example is drawn equally
often. Data-parallel rank ``r`` of ``D`` takes the contiguous slice ``[r * B / D, (r + 1) * B / D)`` of
each global batch: the shares are disjoint and, concatenated in rank order, are the global batch, which
is therefore the same for every DP size.

The whole state is the number of indices consumed (plus the seed and dataset size, checked on load),
so a resumed run continues the exact sequence of an uninterrupted one, also with another DP size.
torch's samplers have no mid-epoch resume and shard per index, not per batch.
"""
from __future__ import annotations

import numpy as np

from megarlhf.core.errors import DataError


class PromptSampler:
    def __init__(self, num_examples: int, global_batch_size: int, seed: int, shuffle: bool = True,
                 dp_rank: int = 0, dp_size: int = 1):
        if num_examples < 1:
            raise DataError(f"PromptSampler: the dataset is empty (num_examples={num_examples})")
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise DataError(f"PromptSampler: global batch size {global_batch_size} must be a positive "
                            f"multiple of the data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"PromptSampler: dp_rank {dp_rank} is not in [0, {dp_size})")
        self.num_examples, self.global_batch_size, self.seed, self.shuffle = (
            num_examples, global_batch_size, seed, shuffle)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = 0
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            else:
                order = np.arange(self.num_examples)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # keep at most two
            self._orders[epoch] = order
        return self._orders[epoch]

    @property
    def epoch(self) -> int:
        """The epoch of the next index to be drawn."""
        return self.consumed // self.num_examples

    def next_global_batch(self) -> list[int]:
        """The next global batch of example indices (all ranks' shares, in rank order)."""
        batch = []
        for position in range(self.consumed, self.consumed + self.global_batch_size):
            epoch, offset = divmod(position, self.num_examples)
            batch.append(int(self._order(epoch)[offset]))
        self.consumed += self.global_batch_size
        return batch

    def next_batch(self) -> list[int]:
        """This rank's share of the next global batch."""
        share = self.global_batch_size // self.dp_size
        return self.next_global_batch()[self.dp_rank * share:(self.dp_rank + 1) * share]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "num_examples": self.num_examples,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_examples", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataError(f"PromptSampler.load_state_dict: the saved {key} is {state[key]!r} but this "
                                f"sampler's is {getattr(self, key)!r}; resuming would draw another sequence")
        self.consumed = int(state["consumed"])
