"""Which generated samples a round of rejection sampling keeps, and which pairs online DPO forms.

Both read the samples of one generation round: ``rewards[k]`` is the reward of sample ``k``, which
answers prompt ``prompt_index[k]`` (the samples of a prompt form its *group*; groups may interleave).
Every rule is deterministic: where rewards tie, the sample that comes first wins, so a rerun (or a
resumed run) keeps the same samples.

``allowed[k]`` False (e.g. a sample cut off by the token limit) means sample ``k`` is never kept and never
chosen; it may still be a pair's rejected side.

* :func:`keep_best` (rejection sampling, ``iterative.rs_keep=best``): the first allowed sample with the
  highest reward of each prompt, if that reward is at least ``threshold`` (None: always).
* :func:`keep_above` (``rs_keep=threshold``): every allowed sample whose reward is at least ``threshold``.
* :func:`preference_pairs` (online DPO): pairs (chosen, rejected) within a prompt's group whose reward
  gap is larger than ``min_margin`` (a gap at or below it is a tie, and ties form no pair) and whose
  responses differ (identical tokens carry no preference, whatever a noisy judge scored).
  ``rule="best_worst"``: one pair per prompt, the first best allowed sample against the first worst
  sample whose response differs from it. ``rule="all"``: every such pair of the group, in (chosen,
  rejected) sample order, each pair of distinct responses once.
"""
from __future__ import annotations

import math
from typing import Sequence

PAIR_RULES = ("best_worst", "all")


def _check_rewards(rewards: Sequence[float]) -> None:
    bad = [k for k, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise ValueError(f"sample {bad[0]} has a non-finite reward {rewards[bad[0]]!r}")


def _groups(rewards: Sequence[float], prompt_index: Sequence[int]) -> dict[int, list[int]]:
    """Sample indices by prompt, in order of first appearance; refuses mismatched or non-finite input."""
    if len(rewards) != len(prompt_index):
        raise ValueError(f"{len(rewards)} rewards for {len(prompt_index)} samples")
    _check_rewards(rewards)
    groups: dict[int, list[int]] = {}
    for k, p in enumerate(prompt_index):
        groups.setdefault(p, []).append(k)
    return groups


def _allowed(allowed: Sequence[bool] | None, count: int) -> Sequence[bool]:
    if allowed is None:
        return [True] * count
    if len(allowed) != count:
        raise ValueError(f"{len(allowed)} allowed flags for {count} samples")
    return allowed


def keep_best(rewards: Sequence[float], prompt_index: Sequence[int], threshold: float | None = None,
              allowed: Sequence[bool] | None = None) -> list[int]:
    """The kept sample of each prompt whose best allowed reward reaches ``threshold``: the first allowed
    sample with the highest reward. Returns sample indices in prompt order of first appearance."""
    allowed = _allowed(allowed, len(rewards))
    kept = []
    for samples in _groups(rewards, prompt_index).values():
        candidates = [k for k in samples if allowed[k]]
        if not candidates:
            continue
        best = max(candidates, key=lambda k: (rewards[k], -k))
        if threshold is None or rewards[best] >= threshold:
            kept.append(best)
    return kept


def keep_above(rewards: Sequence[float], threshold: float, allowed: Sequence[bool] | None = None) -> list[int]:
    """Every allowed sample whose reward is at least ``threshold``, in sample order."""
    _check_rewards(rewards)
    allowed = _allowed(allowed, len(rewards))
    return [k for k, r in enumerate(rewards) if r >= threshold and allowed[k]]


def preference_pairs(rewards: Sequence[float], prompt_index: Sequence[int], responses: Sequence[Sequence[int]],
                     rule: str = "best_worst", min_margin: float = 0.0,
                     allowed: Sequence[bool] | None = None) -> list[tuple[int, int]]:
    """(chosen, rejected) sample indices by ``rule`` (see the module docstring)."""
    if rule not in PAIR_RULES:
        raise ValueError(f"unknown pair rule {rule!r}; known: {', '.join(PAIR_RULES)}")
    if min_margin < 0:
        raise ValueError(f"min_margin must be >= 0, got {min_margin}")
    allowed = _allowed(allowed, len(rewards))

    def forms_pair(i: int, j: int) -> bool:
        return allowed[i] and rewards[i] - rewards[j] > min_margin and list(responses[i]) != list(responses[j])

    pairs = []
    for samples in _groups(rewards, prompt_index).values():
        if rule == "best_worst":
            candidates = [k for k in samples if allowed[k]]
            if not candidates:
                continue
            best = max(candidates, key=lambda k: (rewards[k], -k))
            rejected = sorted((k for k in samples if forms_pair(best, k)), key=lambda k: (rewards[k], k))
            pairs += [(best, rejected[0])] if rejected else []
            continue
        seen = set()
        for i in samples:
            for j in samples:
                key = (tuple(responses[i]), tuple(responses[j]))
                if forms_pair(i, j) and key not in seen:
                    seen.add(key)
                    pairs.append((i, j))
    return pairs
