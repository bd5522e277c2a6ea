"""ParallelConfig: data-parallel size is derived, and layouts that don't divide the world are refused."""
import pytest

from parallel.config import ParallelConfig


def test_data_parallel_size_is_what_is_left():
    assert ParallelConfig(2, 2, 1).data_parallel_size(8) == 2
    assert ParallelConfig(1, 1, 2).data_parallel_size(2) == 1
    assert ParallelConfig().data_parallel_size(3) == 3


def test_layout_not_dividing_world_names_every_size():
    with pytest.raises(ValueError, match=r"world size 6 .*tensor_model_parallel_size \(4\)"):
        ParallelConfig(4, 1, 1).validate(6)


@pytest.mark.parametrize("field", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "context_parallel_size"])
def test_non_positive_sizes_are_refused_by_name(field):
    with pytest.raises(ValueError, match=f"ParallelConfig.{field} must be a positive integer"):
        ParallelConfig(**{field: 0})
