"""ParallelConfig: data-parallel size is derived, and layouts that don't divide the world are refused."""
import pytest

from megarlhf.config.parallel import ParallelConfig


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


@pytest.mark.parametrize("layout, layers, split", [
    (ParallelConfig(1, 4, 1, 6, 6), 30, [6, 9, 9, 6]),  # SmolLM2 at PP=4
    (ParallelConfig(2, 8, 1, 3, 1), 28, [3, 4, 4, 4, 4, 4, 4, 1]),  # Qwen2.5-7B at PP=8
    (ParallelConfig(1, 2, 1, 1), 4, [1, 3]),
    (ParallelConfig(1, 3, 1, None, 2), 8, [3, 3, 2]),
    (ParallelConfig(1, 4), 32, [8, 8, 8, 8]),
    (ParallelConfig(), 5, [5]),
])
def test_stage_layers_follow_the_first_and_last_stage_counts(layout, layers, split):
    assert layout.stage_layers(layers) == split


@pytest.mark.parametrize("layout, layers, message", [
    (ParallelConfig(1, 4), 30, r"pipeline_model_parallel_size=4 cannot split the model's 30 layers.*set "
                               r"num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"),
    (ParallelConfig(1, 4, 1, 6, 5), 30, r"num_layers_in_last_pipeline_stage=5 cannot split .*2 stage\(s\) without "
                                        r"a given count would share 19 layers unequally"),
    (ParallelConfig(1, 2, 1, 1, 1), 4, r"0 stage\(s\) without a given count would share 2 layers"),
    (ParallelConfig(1, 3, 1, 7), 8, r"would share 1 layers unequally or hold none"),
])
def test_a_split_that_cannot_be_made_is_refused_naming_the_fields(layout, layers, message):
    from megarlhf.config.parallel import LayoutError

    with pytest.raises(LayoutError, match=message):
        layout.stage_layers(layers)


@pytest.mark.parametrize("kwargs, message", [
    (dict(pipeline_model_parallel_size=1, num_layers_in_first_pipeline_stage=2),
     "num_layers_in_first_pipeline_stage=2 needs pipeline_model_parallel_size >= 2"),
    (dict(pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=0),
     "num_layers_in_last_pipeline_stage must be a positive integer or null, got 0"),
])
def test_bad_stage_counts_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)
