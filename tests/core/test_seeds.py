"""megarlhf.core.seeds: the sample-seed formula and the bound under which the seed streams stay disjoint."""
from megarlhf.core.seeds import EVAL_OFFSET, ROUND_STRIDE, STEP_STRIDE, TURN_STRIDE, sample_seed


def _streams(batch: int, steps: int, turns: int) -> list[tuple[int, int]]:
    """[start, end) of every step's training, extra-round, evaluation and later-turn seeds (run seed 0)."""
    spans = []
    for step in range(steps):
        for base in (0, ROUND_STRIDE, EVAL_OFFSET):
            first = sample_seed(base, step, 0, 1)
            spans += [(first + t * TURN_STRIDE, first + t * TURN_STRIDE + batch) for t in range(turns)]
    return sorted(spans)


def _overlap(spans) -> bool:
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_sample_seed_is_the_run_seed_plus_step_and_global_position():
    assert sample_seed(7, 0, 0, 8) == 7 and sample_seed(7, 0, 3, 8) == 7 + 24
    assert sample_seed(7, 2, 3, 8) == 7 + 2 * STEP_STRIDE + 24


def test_streams_are_disjoint_up_to_the_documented_batch_bound():
    bound = 8 * STEP_STRIDE - TURN_STRIDE  # 80,031 samples per step (module docstring)
    assert bound == 80_031
    assert not _overlap(_streams(bound, steps=12, turns=3))
    assert _overlap(_streams(bound + 1, steps=12, turns=2))  # turn 1 of step 0 meets step 8
    assert not _overlap(_streams(STEP_STRIDE, steps=12, turns=1))  # single-turn: up to the step stride
