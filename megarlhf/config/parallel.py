"""The typed parallel layout of one model: tensor, pipeline, context, expert and (derived) data parallel
sizes, and how many layers each pipeline stage holds."""
from __future__ import annotations

from dataclasses import dataclass


UNEVEN_STAGE_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


class LayoutError(ValueError):
    """A parallel layout that the job's ranks or the model cannot take (the message names the sizes). A
    problem with the user's config: the command line prints it as one line."""


@dataclass
class ParallelConfig:
    """How one model is split over the ranks of a job.

    The data-parallel size is not a field: it is whatever is left of the world size once tensor,
    pipeline and context parallelism have taken their share (``world = tp * pp * cp * dp``).

    Expert parallelism (mixture-of-experts models) splits each MoE layer's experts over
    ``expert_model_parallel_size`` ranks. Megatron lays the expert groups out over the same ranks as the
    dense ones: expert tensor parallelism equals ``tensor_model_parallel_size`` (Megatron's default), the
    EP ranks come out of the dense data x context ranks, and the expert data-parallel size is what is left:
    ``world = tp * ep * pp * expert_dp``. A dense model ignores it (it must be 1 there).

    Pipeline stages hold equal numbers of layers unless the first and/or last stage's count is given
    (Megatron's fields of the same names); the other stages then share the remaining layers equally. A
    model whose layer count PP does not divide (SmolLM2's 30 at PP=4: 6 + 9 + 9 + 6) needs them, and a
    lighter first or last stage offsets the embedding and the LM head.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    expert_model_parallel_size: int = 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def expert_layout_size(self) -> int:
        """Ranks one copy of the experts spans: expert-TP (= TP) x EP x PP."""
        return self.tensor_model_parallel_size * self.expert_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks; raises if the layout does not divide it."""
        self.validate(world_size)
        return world_size // self.model_parallel_size

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        for name in UNEVEN_STAGE_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"ParallelConfig.{name} must be a positive integer or null, got {value!r}")
            if self.pipeline_model_parallel_size < 2:
                raise LayoutError(f"ParallelConfig.{name}={value} needs pipeline_model_parallel_size >= 2 "
                                  f"(got {self.pipeline_model_parallel_size})")

    @property
    def uneven_stages(self) -> dict[str, int]:
        """The uneven-stage fields that are set (Megatron's TransformerConfig takes them by these names)."""
        return {name: getattr(self, name) for name in UNEVEN_STAGE_FIELDS if getattr(self, name) is not None}

    def stage_layers(self, num_layers: int) -> list[int]:
        """How many of a model's ``num_layers`` layers each pipeline stage holds; raises a LayoutError
        naming the fields when they cannot be split so (every stage needs at least one layer, and the
        stages between a given first and last share the rest equally)."""
        pp = self.pipeline_model_parallel_size
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        given = {0: first, pp - 1: last} if pp > 1 else {}
        given = {stage: n for stage, n in given.items() if n is not None}
        rest, shared_by = num_layers - sum(given.values()), pp - len(given)
        if rest < shared_by or (shared_by == 0 and rest != 0) or (shared_by and rest % shared_by):
            fields = ", ".join(f"{k}={v}" for k, v in self.uneven_stages.items())
            raise LayoutError(f"pipeline_model_parallel_size={pp}{', ' + fields if fields else ''} cannot split the "
                              f"model's {num_layers} layers: the {shared_by} stage(s) without a given count would "
                              f"share {rest} layers unequally or hold none" + ("" if fields else "; set "
                              "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage for uneven "
                              "stages"))
        return [given.get(stage, rest // shared_by if shared_by else 0) for stage in range(pp)]

    def validate(self, world_size: int) -> None:
        """Raises unless the layout divides ``world_size`` ranks."""
        if world_size % self.model_parallel_size:
            raise LayoutError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size "
                f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) x context_parallel_size ({self.context_parallel_size}) "
                f"= {self.model_parallel_size}"
            )
        if world_size % self.expert_layout_size:
            raise LayoutError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size "
                f"({self.tensor_model_parallel_size}) x expert_model_parallel_size ({self.expert_model_parallel_size}) "
                f"x pipeline_model_parallel_size ({self.pipeline_model_parallel_size}) = {self.expert_layout_size} "
                f"(the ranks one copy of the experts spans)")
