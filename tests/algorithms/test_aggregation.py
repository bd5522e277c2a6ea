"""Loss aggregation against naive global-batch references: over micro-batches in one process, and over
2 data-parallel ranks under torchrun (gloo) with unequal token counts per rank, for the loss value and
its gradient; plus data-parallel whitening of advantages against the single-process result."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _rl_dp_batch import LAYOUT, initial_theta, micro_batches, per_token_loss
from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, aggregate_loss, compute_normaliser
from megarlhf.config.algorithm import AGGREGATION_MODES, AdvantageConfig
from megarlhf.testing.launch import read_rank_results, run_torchrun

HERE = Path(__file__).parent
MAX_RESPONSE_LENGTH = 8  # the worker's Dr. GRPO constant


def _all_batches():
    return [b for rank in sorted(LAYOUT) for b in micro_batches(rank)]


def naive_global_loss(theta: torch.Tensor, batches, mode: str) -> torch.Tensor:
    """The global loss written out row by row over the concatenated batch (no aggregate_loss)."""
    rows = []
    for batch in batches:
        loss = per_token_loss(theta, batch["x"])
        for i in range(loss.shape[0]):
            rows.append(loss[i][batch["mask"][i]])
    if mode == "token_mean":
        return torch.cat(rows).mean()
    if mode == "seq_mean_token_sum":
        return torch.stack([r.sum() for r in rows]).mean()
    if mode == "seq_mean_token_mean":
        return torch.stack([r.mean() for r in rows]).mean()
    if mode == "seq_mean_token_sum_norm":
        return torch.stack([r.sum() / MAX_RESPONSE_LENGTH for r in rows]).mean()
    raise AssertionError(mode)


def _reference(mode: str, batches):
    theta = initial_theta().requires_grad_(True)
    value = naive_global_loss(theta, batches, mode)
    value.backward()
    return value.item(), theta.grad


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batch_shares_sum_to_global_loss_and_gradient(mode):
    batches = _all_batches()  # 3 micro-batches of unequal size in one process
    normaliser = compute_normaliser([b["mask"] for b in batches], None, MAX_RESPONSE_LENGTH)
    assert normaliser.grad_average_factor == 1
    assert normaliser.num_tokens == sum(sum(lengths) for layout in LAYOUT.values() for lengths in layout)
    assert normaliser.num_sequences == 9
    theta = initial_theta().requires_grad_(True)
    total = 0.0
    for batch in batches:
        share = aggregate_loss(per_token_loss(theta, batch["x"]), batch["mask"], mode, normaliser)
        share.backward()
        total += share.item()
    ref_value, ref_grad = _reference(mode, batches)
    assert abs(total - ref_value) <= 1e-12
    assert torch.allclose(theta.grad, ref_grad, rtol=0, atol=1e-12)


def test_mean_of_micro_batch_means_would_differ():
    """Guards the test above: on this batch the naive per-micro-batch mean is measurably wrong."""
    batches = _all_batches()
    theta = initial_theta()
    per_mb = [per_token_loss(theta, b["x"])[b["mask"]].mean() for b in batches]
    assert abs(torch.stack(per_mb).mean().item() - _reference("token_mean", batches)[0]) > 1e-3


def test_nan_in_padding_of_loss_is_not_read():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), float("nan")]], requires_grad=True)
    normaliser = compute_normaliser([mask], None, 4)
    for mode in AGGREGATION_MODES:
        loss.grad = None
        value = aggregate_loss(loss, mask, mode, normaliser)
        value.backward()
        expected = {"token_mean": 7.0 / 3, "seq_mean_token_sum": (3.0 + 4.0) / 2,
                    "seq_mean_token_mean": (1.5 + 4.0) / 2, "seq_mean_token_sum_norm": 7.0 / (2 * 4)}[mode]
        assert abs(value.item() - expected) <= 1e-6
        assert torch.isfinite(loss.grad).all() and (loss.grad[~mask] == 0).all()


def test_errors_name_the_problem():
    mask = torch.ones(2, 3)
    empty = compute_normaliser([torch.zeros(2, 3)])  # an all-masked batch is counted, not refused...
    assert (empty.num_tokens, empty.num_sequences) == (0, 0)
    with pytest.raises(ValueError, match="no response token"):  # ...but it has no loss to average
        aggregate_loss(torch.zeros(2, 3), torch.zeros(2, 3), "token_mean", empty)
    with pytest.raises(ValueError, match="masks is empty"):
        compute_normaliser([])
    normaliser = compute_normaliser([mask])
    with pytest.raises(ValueError, match="unknown mode 'mean'"):
        aggregate_loss(torch.zeros(2, 3), mask, "mean", normaliser)
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate_loss(torch.zeros(2, 3), mask, "seq_mean_token_sum_norm", normaliser)
    with pytest.raises(ValueError, match="loss has shape"):
        aggregate_loss(torch.zeros(2, 4), mask, "token_mean", normaliser)


def test_two_data_parallel_ranks_match_single_process(tmp_path):
    run_torchrun(HERE / "_worker_rl_dp.py", 2, [str(tmp_path)], timeout_s=180)
    results = read_rank_results(tmp_path, 2)
    batches = _all_batches()
    tokens = [int(b["mask"].sum()) for rank in sorted(LAYOUT) for b in micro_batches(rank)]
    assert tokens[0] + tokens[1] != tokens[2]  # the ranks hold unequal token counts
    for result in results:
        assert result["num_tokens"] == sum(tokens) and result["num_sequences"] == 9
        assert result["factor"] == 2
        for mode in AGGREGATION_MODES:
            ref_value, ref_grad = _reference(mode, batches)
            assert abs(result["modes"][mode]["loss"] - ref_value) <= 1e-12, mode
            grad = torch.tensor(result["modes"][mode]["grad"], dtype=torch.float64)
            assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-12), mode
    # Whitening over both ranks equals whitening the concatenated batch in one process.
    config = AdvantageConfig(gamma=0.9, lam=0.8)
    inputs = AdvantageInputs(rewards=torch.cat([b["rewards"] for b in batches]),
                             response_mask=torch.cat([b["mask"] for b in batches]),
                             values=torch.cat([b["values"] for b in batches]))
    rows_rank0 = sum(len(lengths) for lengths in LAYOUT[0])
    for name in ("reinforce_pp", "gae"):
        single = ADVANTAGE_ESTIMATORS.get(name)(inputs, config).advantages
        distributed = torch.tensor(results[0][name] + results[1][name], dtype=torch.float64)
        assert len(results[0][name]) == rows_rank0
        assert torch.allclose(distributed, single, rtol=0, atol=1e-12), name
