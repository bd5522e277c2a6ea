"""Advantage estimators against hand-worked values and plain-Python references (loops over lists,
the statistics module), plus properties: zero group mean with interleaved unequal groups, GAE with
gamma = lambda = 1 equals returns - values, padding never read, clear errors for missing inputs."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs
from megarlhf.config.algorithm import AdvantageConfig

EPS = 1e-6
NAN = float("nan")

# Three rows; row 1 has a hole in its mask (e.g. a masked tool output) and row 2 right padding.
MASK = [[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 0]]
VALUES = [[0.5, 0.2, 0.1, -0.3], [1.0, NAN, 0.4, 0.2], [0.3, -0.1, NAN, NAN]]
TOKEN_REWARDS = [[0.0, -0.1, 0.05, 0.0], [-0.2, NAN, 0.0, 0.1], [0.0, 0.3, NAN, NAN]]
REWARDS = [1.0, -0.5, 2.0]


def _t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def _inputs(**over) -> AdvantageInputs:
    fields = dict(rewards=_t(REWARDS), response_mask=_t(MASK).bool(), values=_t(VALUES),
                  token_rewards=_t(TOKEN_REWARDS))
    fields.update(over)
    return AdvantageInputs(**fields)


def _rows(mask, matrix):
    """Per row, the list of masked-in entries (plain Python)."""
    return [[matrix[b][t] for t in range(len(mask[b])) if mask[b][t]] for b in range(len(mask))]


def _spread(mask, per_row):
    """Per-row lists of masked-in entries back to a padded matrix with zeros."""
    out = []
    for b, row in enumerate(mask):
        it = iter(per_row[b])
        out.append([next(it) if m else 0.0 for m in row])
    return _t(out)


def _token_rewards_rows():
    rows = _rows(MASK, TOKEN_REWARDS)
    for b, row in enumerate(rows):
        row[-1] += REWARDS[b]
    return rows


def ref_gae_rows(gamma, lam):
    advantages, returns = [], []
    for r, v in zip(_token_rewards_rows(), _rows(MASK, VALUES)):
        adv, running = [0.0] * len(r), 0.0
        for k in reversed(range(len(r))):
            next_v = v[k + 1] if k + 1 < len(r) else 0.0
            running = r[k] + gamma * next_v - v[k] + gamma * lam * running
            adv[k] = running
        advantages.append(adv)
        returns.append([a + vv for a, vv in zip(adv, v)])
    return advantages, returns


def ref_whiten_rows(rows):
    flat = [x for row in rows for x in row]
    mean, std = statistics.fmean(flat), statistics.pstdev(flat)
    return [[(x - mean) / (std + EPS) for x in row] for row in rows]


def ref_discounted_rows(reward_rows, gamma):
    out = []
    for r in reward_rows:
        g, running = [0.0] * len(r), 0.0
        for k in reversed(range(len(r))):
            running = r[k] + gamma * running
            g[k] = running
        out.append(g)
    return out


def test_gae_hand_worked_single_row():
    # gamma 0.9, lambda 0.8, values (0.5, 0.2, 0.1), reward 1 on the last token:
    # delta2 = 1 - 0.1 = 0.9                A2 = 0.9
    # delta1 = 0.9 * 0.1 - 0.2 = -0.11      A1 = -0.11 + 0.72 * 0.9 = 0.538
    # delta0 = 0.9 * 0.2 - 0.5 = -0.32      A0 = -0.32 + 0.72 * 0.538 = 0.06736
    inputs = AdvantageInputs(rewards=_t([1.0]), response_mask=torch.ones(1, 3),
                             values=_t([[0.5, 0.2, 0.1]]))
    config = AdvantageConfig(gamma=0.9, lam=0.8, gae_whiten=False)
    out = ADVANTAGE_ESTIMATORS.get("gae")(inputs, config)
    assert torch.allclose(out.advantages, _t([[0.06736, 0.538, 0.9]]), rtol=0, atol=1e-12)
    assert torch.allclose(out.returns, _t([[0.56736, 0.738, 1.0]]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("whiten", [False, True])
def test_gae_matches_python_reference(whiten):
    config = AdvantageConfig(gamma=0.9, lam=0.8, gae_whiten=whiten)
    out = ADVANTAGE_ESTIMATORS.get("gae")(_inputs(), config)
    adv_rows, ret_rows = ref_gae_rows(0.9, 0.8)
    if whiten:
        adv_rows = ref_whiten_rows(adv_rows)
    assert torch.allclose(out.advantages, _spread(MASK, adv_rows), rtol=0, atol=1e-12)
    assert torch.allclose(out.returns, _spread(MASK, ret_rows), rtol=0, atol=1e-12)


def test_gae_gamma_lambda_one_is_returns_minus_values():
    config = AdvantageConfig(gamma=1.0, lam=1.0, gae_whiten=False)
    out = ADVANTAGE_ESTIMATORS.get("gae")(_inputs(), config)
    to_go = [[sum(r[k:]) for k in range(len(r))] for r in _token_rewards_rows()]
    minus_values = [[g - v for g, v in zip(gs, vs)] for gs, vs in zip(to_go, _rows(MASK, VALUES))]
    assert torch.allclose(out.advantages, _spread(MASK, minus_values), rtol=0, atol=1e-12)
    assert torch.allclose(out.returns, _spread(MASK, to_go), rtol=0, atol=1e-12)


# Interleaved, out-of-order groups of unequal size (7: 3 samples, 2: 2 samples, 9: 4 samples, 4: 1).
GROUPS = [7, 2, 9, 7, 9, 4, 2, 9, 7, 9]
G_REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 3.0, 1.0, 0.25, 1.0, 0.0]
G_LENGTHS = [3, 1, 4, 2, 4, 3, 1, 2, 4, 3]


def _group_inputs(token_rewards=None, **over):
    mask = torch.arange(4)[None, :] < torch.tensor(G_LENGTHS)[:, None]
    fields = dict(rewards=_t(G_REWARDS), response_mask=mask, group_ids=torch.tensor(GROUPS),
                  token_rewards=token_rewards)
    fields.update(over)
    return AdvantageInputs(**fields)


def _members(i):
    return [j for j in range(len(GROUPS)) if GROUPS[j] == GROUPS[i]]


def _expected_per_sample(per_sample):
    mask = (torch.arange(4)[None, :] < torch.tensor(G_LENGTHS)[:, None]).tolist()
    return _spread(mask, [[per_sample[i]] * G_LENGTHS[i] for i in range(len(GROUPS))])


def test_grpo_against_python_reference_and_zero_group_mean():
    out = ADVANTAGE_ESTIMATORS.get("grpo")(_group_inputs(), AdvantageConfig(eps=EPS))
    expected = []
    for i in range(len(GROUPS)):
        rewards = [G_REWARDS[j] for j in _members(i)]
        std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
        expected.append((G_REWARDS[i] - statistics.fmean(rewards)) / (std + EPS))
    assert torch.allclose(out.advantages, _expected_per_sample(expected), rtol=0, atol=1e-12)
    per_sample = out.advantages[:, 0]
    for group in set(GROUPS):
        members = [j for j in range(len(GROUPS)) if GROUPS[j] == group]
        assert abs(per_sample[members].sum().item()) <= 1e-12
    assert per_sample[5].item() == 0.0  # the single-sample group
    assert torch.allclose(out.returns, _expected_per_sample(G_REWARDS), rtol=0, atol=0)


def test_grpo_adds_token_rewards_to_the_sequence_return():
    token_rewards = torch.full((10, 4), -0.1, dtype=torch.float64)
    out = ADVANTAGE_ESTIMATORS.get("dr_grpo")(_group_inputs(token_rewards), AdvantageConfig())
    returns = [G_REWARDS[i] - 0.1 * G_LENGTHS[i] for i in range(len(GROUPS))]
    expected = [returns[i] - statistics.fmean(returns[j] for j in _members(i)) for i in range(10)]
    assert torch.allclose(out.advantages, _expected_per_sample(expected), rtol=0, atol=1e-12)


def test_dr_grpo_is_centred_but_not_scaled():
    out = ADVANTAGE_ESTIMATORS.get("dr_grpo")(_group_inputs(), AdvantageConfig())
    expected = [G_REWARDS[i] - statistics.fmean(G_REWARDS[j] for j in _members(i)) for i in range(10)]
    assert torch.allclose(out.advantages, _expected_per_sample(expected), rtol=0, atol=1e-12)


def test_rloo_leave_one_out():
    keep = [i for i in range(10) if GROUPS[i] != 4]  # RLOO needs >= 2 samples per group
    inputs = _group_inputs()
    inputs = AdvantageInputs(rewards=inputs.rewards[keep], response_mask=inputs.response_mask[keep],
                             group_ids=inputs.group_ids[keep])
    out = ADVANTAGE_ESTIMATORS.get("rloo")(inputs, AdvantageConfig())
    expected = []
    for i in keep:
        others = [G_REWARDS[j] for j in _members(i) if j != i]
        expected.append(G_REWARDS[i] - sum(others) / len(others))
    # hand-worked example: group 2 = rewards (0, 1): advantages 0 - 1 = -1 and 1 - 0 = 1
    assert expected[1] == -1.0 and expected[5] == 1.0
    assert torch.allclose(out.advantages[:, 0], _t(expected), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"groups \[4\] have one"):
        ADVANTAGE_ESTIMATORS.get("rloo")(_group_inputs(), AdvantageConfig())


def test_remax_subtracts_greedy_reward():
    baseline = _t([0.5] * 10)
    out = ADVANTAGE_ESTIMATORS.get("remax")(_group_inputs(baseline_rewards=baseline), AdvantageConfig())
    assert torch.allclose(out.advantages, _expected_per_sample([r - 0.5 for r in G_REWARDS]), atol=1e-12)


def test_reinforce_pp_against_python_reference():
    config = AdvantageConfig(gamma=0.9, eps=EPS)
    out = ADVANTAGE_ESTIMATORS.get("reinforce_pp")(_inputs(), config)
    returns = ref_discounted_rows(_token_rewards_rows(), 0.9)
    assert torch.allclose(out.returns, _spread(MASK, returns), rtol=0, atol=1e-12)
    assert torch.allclose(out.advantages, _spread(MASK, ref_whiten_rows(returns)), rtol=0, atol=1e-12)
    flat = out.advantages[_t(MASK).bool()]
    assert abs(flat.mean().item()) <= 1e-12 and abs(flat.std(unbiased=False).item() - 1) <= 1e-5


def test_reinforce_pp_baseline_against_python_reference():
    groups = [3, 1, 3]
    config = AdvantageConfig(gamma=0.9, eps=EPS)
    out = ADVANTAGE_ESTIMATORS.get("reinforce_pp_baseline")(_inputs(group_ids=torch.tensor(groups)), config)
    centred = [REWARDS[0] - 1.5, 0.0, REWARDS[2] - 1.5]  # group 3 = rows 0 and 2 (mean 1.5)
    rows = _rows(MASK, TOKEN_REWARDS)
    for b, row in enumerate(rows):
        row[-1] += centred[b]
    returns = ref_discounted_rows(rows, 0.9)
    assert torch.allclose(out.returns, _spread(MASK, returns), rtol=0, atol=1e-12)
    assert torch.allclose(out.advantages, _spread(MASK, ref_whiten_rows(returns)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
@pytest.mark.parametrize("garbage", [NAN, 1e30, -math.inf])
def test_padding_is_never_read(name, garbage):
    mask = _t(MASK).bool()

    def fill(matrix):
        return torch.where(mask, _t(matrix).nan_to_num(0.0), torch.full((3, 4), garbage, dtype=torch.float64))

    common = dict(group_ids=torch.tensor([0, 1, 0]) if name != "rloo" else torch.tensor([0, 0, 0]),
                  baseline_rewards=_t([0.1, 0.2, 0.3]))
    clean = _inputs(values=fill(VALUES).where(mask, 0.0), token_rewards=fill(TOKEN_REWARDS).where(mask, 0.0),
                    **common)
    dirty = _inputs(values=fill(VALUES), token_rewards=fill(TOKEN_REWARDS), **common)
    config = AdvantageConfig()
    a, b = ADVANTAGE_ESTIMATORS.get(name)(clean, config), ADVANTAGE_ESTIMATORS.get(name)(dirty, config)
    assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)
    assert torch.isfinite(b.advantages).all()
    assert (b.advantages[~mask] == 0).all() and (b.returns[~mask] == 0).all()


@pytest.mark.parametrize("name, field", [("gae", "values"), ("grpo", "group_ids"), ("dr_grpo", "group_ids"),
                                         ("rloo", "group_ids"), ("remax", "baseline_rewards"),
                                         ("reinforce_pp_baseline", "group_ids")])
def test_missing_inputs_raise_naming_the_field(name, field):
    inputs = _inputs(**{field: None}) if field == "values" else _inputs()
    with pytest.raises(ValueError, match=f"{name}.*AdvantageInputs.{field}"):
        ADVANTAGE_ESTIMATORS.get(name)(inputs, AdvantageConfig())


def test_bad_inputs_and_config_are_named():
    with pytest.raises(ValueError, match=r"values has shape \(3, 3\), expected \(3, 4\)"):
        _inputs(values=torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"rows \[1\] of response_mask have no response token"):
        _inputs(response_mask=torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"rewards is not finite at rows \[2\]"):
        _inputs(rewards=_t([1.0, 0.0, NAN]))
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        _inputs(group_ids=_t([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match=r"AdvantageConfig.gamma must be in \[0, 1\]"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(ValueError, match="AdvantageConfig.eps must be > 0"):
        AdvantageConfig(eps=0.0)
    with pytest.raises(KeyError, match="unknown advantage estimator 'ppo'"):
        ADVANTAGE_ESTIMATORS.get("ppo")
