"""The repository-editing task: generated tasks (megarlhf.data.repo_tasks), the ``repo`` environment and the
``repo_tests`` reward. The fix of every template is the edit from its buggy body to its correct one; a
transcript that makes it scores 1 on the hidden tests, the unedited repository less, and the environment's
state between calls is the replay of the earlier turns' edits."""
from __future__ import annotations

import json

import pytest

from megarlhf.data.repo_tasks import TEMPLATES, write_tasks
from megarlhf.envs import ENVIRONMENTS, ParsedCall
from megarlhf.isolation.sandbox import isolation, run_tests
from megarlhf.rewards import RewardInput
from megarlhf.rewards.repo import repo_tests

pytestmark = pytest.mark.skipif(isolation() != "namespaces", reason="the code sandbox cannot isolate here")
BY_NAME = {t.name: t for t in TEMPLATES}


def _call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("repo")
    assert write_tasks(out, 120, 30, seed=3) == {"train": 120, "heldout": 30}
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    return train, heldout


def _one_per_template(rows) -> list[dict]:
    found = {}
    for row in rows[0] + rows[1]:
        found.setdefault(row["template"], row)
    return list(found.values())


def _fix(row: dict) -> str:
    template, module = BY_NAME[row["template"]], next(p for p in row["files"] if p.endswith("/core.py"))
    return _call("edit", path=module, old=template.buggy, new=template.correct)


def test_tasks_are_disjoint_and_their_bug_fails_tests_the_fix_passes(rows):
    train, heldout = rows
    key = lambda r: json.dumps([r["files"], r["hidden_tests"]], sort_keys=True)  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in heldout}
    chosen = _one_per_template(rows)
    assert len(chosen) >= 6
    for row in chosen:
        buggy = run_tests(row["program"], row["visible_tests"] + row["hidden_tests"], files=row["files"])
        assert buggy.status == "ok" and 0 < buggy.total - buggy.passed, row["template"]
        assert "test_core.py" in row["files"] and row["visible_tests"][0]["call"] in row["files"]["test_core.py"]


def test_the_fix_scores_one_and_the_last_turns_edit_does_not_count(rows):
    for row in _one_per_template(rows):
        unedited = repo_tests(RewardInput("p", "r", metadata=row))
        assert unedited < 1.0
        fixed = (_call("view", path="test_core.py"), _fix(row), _call("run_tests"), "Done: the tests pass.")
        assert repo_tests(RewardInput("p", "r", metadata=row, turns=fixed)) == 1.0, row["template"]
        assert repo_tests(RewardInput("p", "r", metadata=row, turns=fixed[:2])) == unedited  # never ran


def test_each_call_sees_the_repository_with_the_earlier_turns_edits(rows):
    row = _one_per_template(rows)[0]
    episode = ENVIRONMENTS.get("repo")(row)
    before = episode.step([{"role": "user", "content": row["prompt"]}, {"role": "assistant",
                                                                        "content": _call("run_tests")}],
                          ParsedCall("run_tests", {}))
    assert not before.observation.startswith("3/3")
    messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": _fix(row)},
                {"role": "tool", "content": "edited"}, {"role": "assistant", "content": _call("run_tests")}]
    after = ENVIRONMENTS.get("repo")(row).step(messages, ParsedCall("run_tests", {}))
    assert after.observation.startswith("3/3 tests passed"), after.observation
    listing = episode.step([], ParsedCall("list_files", {})).observation
    assert listing.splitlines() == sorted(row["files"])


@pytest.mark.parametrize("arguments, message", [
    ({"path": "../../etc/passwd", "old": "a", "new": "b"}, "no file '../../etc/passwd'"),
    ({"path": "test_core.py", "old": "not in the file", "new": "b"}, "found 0 times"),
    ({"path": "test_core.py", "old": "assert", "new": "b"}, "found 3 times"),
    ({"path": "test_core.py", "old": "", "new": "b"}, "must not be empty"),
    ({"path": "test_core.py", "old": ["a"], "new": "b"}, "'old' must be a string, got list"),
    ({"path": "test_core.py", "old": "test_0", "new": "x" * (5 * 2**20)}, "bytes (at most"),
    ({"path": "test_core.py", "old": "test_0", "new": "\udc80"}, "not valid Unicode"),
])
def test_bad_edits_are_refused_and_change_nothing(rows, arguments, message):
    row = _one_per_template(rows)[0]
    episode = ENVIRONMENTS.get("repo")(row)
    result = episode.step([], ParsedCall("edit", arguments))
    assert result.observation.startswith("error: ") and message in result.observation, result.observation
    assert episode.files == row["files"]
    assert episode.step([], ParsedCall("view", {"path": "/etc/passwd"})).observation.startswith("error: no file")


def test_a_call_format_a_reward_cannot_replay_is_refused(rows):
    with pytest.raises(ValueError, match="replay calls in the 'hermes' format"):
        ENVIRONMENTS.get("repo")(rows[0][0], parser="mistral")
    with pytest.raises(ValueError, match="replay calls in the 'hermes' format"):
        repo_tests(RewardInput("p", "r", metadata=rows[0][0]), parser="mistral")


def test_a_row_without_a_repository_is_named():
    with pytest.raises(ValueError, match="the row's 'files' field"):
        ENVIRONMENTS.get("repo")({"program": "import x", "visible_tests": [{"call": "f()", "expected": 1}]})
    with pytest.raises(ValueError, match="'visible_tests' field"):
        ENVIRONMENTS.get("repo")({"files": {"a.py": ""}, "program": "from a import *"})
