"""Dotted-path user functions, reward name resolution and RewardConfig validation."""
from __future__ import annotations

import textwrap

import pytest

from megarlhf.rewards import REWARDS, RewardInput, load_function, resolve_reward
from megarlhf.config.reward import RewardConfig, RewardSpec


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "my_mod.py").write_text(textwrap.dedent("""
        LIMIT = 3
        def length_reward(sample, scale=1.0):
            return scale * len(sample.response)
    """))
    (pkg / "broken.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_pkg"


def test_dotted_path_forms(user_module):
    sample = RewardInput("p", "abcd")
    for path in ("my_pkg.my_mod:length_reward", "my_pkg.my_mod.length_reward"):
        fn = resolve_reward(path)
        assert fn(sample) == 4.0 and fn(sample, scale=0.5) == 2.0


def test_dotted_path_errors_name_the_path(user_module):
    with pytest.raises(ValueError, match=r"'my_pkg\.nope:fn': cannot import module 'my_pkg\.nope'"):
        load_function("my_pkg.nope:fn")
    with pytest.raises(ValueError, match=r"'my_pkg\.broken:fn'.*ModuleNotFoundError.*not_a_module_anywhere"):
        load_function("my_pkg.broken:fn")
    with pytest.raises(ValueError, match=r"module 'my_pkg\.my_mod' has no attribute 'missing'"):
        load_function("my_pkg.my_mod:missing")
    with pytest.raises(ValueError, match=r"'my_pkg\.my_mod:LIMIT' is a int, not a callable"):
        load_function("my_pkg.my_mod:LIMIT")


def test_unknown_reward_name_lists_known():
    with pytest.raises(ValueError, match=r"^reward.functions.0: unknown reward function 'math_verfy'; known: "
                                         r".*exact_match.*math_verify.*, or a dotted path 'pkg.module:name'$"):
        REWARDS.check_name("math_verfy", "reward.functions.0", dotted_path=True)
    REWARDS.check_name("my_pkg.rewards:score", "reward.functions.0", dotted_path=True)  # user code by path
    with pytest.raises(ValueError, match="known: "):
        resolve_reward("nonsense")
    assert {"exact_match", "numeric", "math_verify"} <= set(REWARDS.names())


def test_reward_config_validation():
    with pytest.raises(ValueError, match=r"timeout_s must be a finite number in \(0, 3600\]"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="names a function twice"):
        RewardConfig(functions=[RewardSpec("numeric"), RewardSpec("numeric")])
    assert RewardConfig(functions=[]).functions == []  # a run's environment may be its reward (RunConfig checks)
