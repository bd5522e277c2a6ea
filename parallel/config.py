"""The typed parallel layout of one model: tensor, pipeline, context and (derived) data parallel sizes."""
from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that the job's ranks or the model cannot take (the message names the sizes). A
    problem with the user's config: the command line prints it as one line."""


@dataclass
class ParallelConfig:
    """How one model is split over the ranks of a job.

    The data-parallel size is not a field: it is whatever is left of the world size once tensor,
    pipeline and context parallelism have taken their share (``world = tp * pp * cp * dp``).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks; raises if the layout does not divide it."""
        self.validate(world_size)
        return world_size // self.model_parallel_size

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")

    def validate(self, world_size: int) -> None:
        """Raises unless the layout divides ``world_size`` ranks."""
        if world_size % self.model_parallel_size:
            raise LayoutError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size "
                f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) x context_parallel_size ({self.context_parallel_size}) "
                f"= {self.model_parallel_size}"
            )
