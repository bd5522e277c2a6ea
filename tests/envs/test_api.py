"""The environment contract: the registry (unknown names list the known ones), a stateful user environment
loaded by dotted path and played through the runner, EnvConfig validation naming the field (also through
the config loader's key paths), ToolSpec and ToolEpisode."""
from __future__ import annotations

import json
import pytest

from megarlhf.config.loader import ConfigError, from_dict
from megarlhf.envs import (ENVIRONMENTS, ParsedCall, StepResult, ToolEpisode, ToolError, ToolRunner, ToolSpec,
                           load_object, resolve_environment)
from megarlhf.config.rollout import EnvConfig

GUESS = ToolSpec("guess", "guess the secret number", {"type": "object", "required": ["number"],
                                                      "properties": {"number": {"type": "integer"}}})


class GuessGame:
    """A per-episode game: the secret comes from the sample's metadata, the guesses are remembered."""

    tools = [GUESS]

    def __init__(self, metadata, win_reward=1.0):
        self.secret = metadata["secret"]
        self.win_reward = win_reward
        self.guesses: list[int] = []

    def step(self, messages, call):
        number = call.arguments["number"]
        self.guesses.append(number)
        if number == self.secret:
            return StepResult(f"correct after {len(self.guesses)} guesses", done=True, reward=self.win_reward)
        return StepResult("higher" if number < self.secret else "lower", info={"guesses": list(self.guesses)})


NOT_CALLABLE = 3
HERE = __name__


def _guess(number: int) -> list[dict]:
    return [{"role": "assistant", "content": f'<tool_call>{{"name": "guess", "arguments": {{"number": {number}}}}}'
                                             f'</tool_call>'}]


def test_registry_lists_known_names():
    assert {"calculator", "lookup"} <= set(ENVIRONMENTS.names())
    with pytest.raises(ValueError, match=r"^unknown environment 'chess'; known: calculator, code, lookup, openenv, repo, or a "
                                         r"dotted path 'pkg.module:factory'$"):
        resolve_environment("chess")
    with pytest.raises(KeyError, match="unknown environment 'chess'; known: calculator, code, lookup, openenv, repo"):
        ENVIRONMENTS.get("chess")
    assert resolve_environment("calculator") is ENVIRONMENTS.get("calculator")


def test_dotted_path_user_environment_keeps_state_per_episode():
    for path in (f"{HERE}:GuessGame", f"{HERE}.GuessGame"):
        assert resolve_environment(path) is GuessGame
    runner = ToolRunner(EnvConfig(f"{HERE}:GuessGame", kwargs={"win_reward": 2.0}, max_turns=5))
    first, second = runner.start([{"secret": 7}, {"secret": 3}])
    batch = runner.step([first, second], [_guess(5), _guess(5)])
    assert [(o.observation, o.info) for o in batch.outcomes] == [("higher", {"guesses": [5]}), ("lower", {"guesses": [5]})]
    batch = runner.step([first, second], [_guess(8), _guess(3)])
    assert [(o.observation, o.done, o.reward) for o in batch.outcomes] == [
        ("lower", False, None), ("correct after 2 guesses", True, 2.0)]
    batch = runner.step([first], [_guess(7)])
    assert (batch.outcomes[0].observation, batch.outcomes[0].reward) == ("correct after 3 guesses", 2.0)
    assert first.episode.guesses == [5, 8, 7] and second.episode.guesses == [5, 3]
    runner.close()


def test_dotted_path_errors():
    with pytest.raises(ValueError, match="environment 'no_such_pkg.mod:Env': cannot import module 'no_such_pkg.mod'"):
        resolve_environment("no_such_pkg.mod:Env")
    with pytest.raises(ValueError, match=f"module '{HERE}' has no attribute 'Missing'"):
        resolve_environment(f"{HERE}:Missing")
    with pytest.raises(ValueError, match=f"environment '{HERE}:NOT_CALLABLE' is a int, not a class or function"):
        resolve_environment(f"{HERE}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="must look like 'pkg.module:name'"):
        load_object("not a path", "environment")


@pytest.mark.parametrize("fields, message", [
    ({"name": ""}, "EnvConfig.name must be a non-empty string, got ''"),
    ({"name": "calculator", "max_turns": 0}, "EnvConfig.max_turns must be an int >= 1, got 0"),
    ({"name": "calculator", "max_turns": True}, "EnvConfig.max_turns must be an int >= 1, got True"),
    ({"name": "calculator", "timeout_s": 0}, "EnvConfig.timeout_s must be a finite number in (0, 3600] seconds, got 0"),
    ({"name": "calculator", "timeout_s": float("inf")}, "EnvConfig.timeout_s must be a finite number in (0, 3600] seconds, got inf"),
    ({"name": "calculator", "max_observation_chars": -1}, "EnvConfig.max_observation_chars must be an int >= 1, got -1"),
    ({"name": "calculator", "num_workers": 0}, "EnvConfig.num_workers must be an int >= 1, got 0"),
    ({"name": "calculator", "kwargs": {1: 2}}, "EnvConfig.kwargs must be a mapping with string keys, got {1: 2}"),
    ({"name": "calculator", "describe_tools": "yes"}, "EnvConfig.describe_tools must be true or false, got 'yes'"),
])
def test_env_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError) as info:
        EnvConfig(**fields)
    assert str(info.value).startswith(message), str(info.value)


def test_env_config_through_the_config_loader():
    config = from_dict(EnvConfig, {"name": "lookup", "kwargs": {"table": {"a": "b"}}, "timeout_s": 1}, "rollout.env")
    assert config == EnvConfig("lookup", {"table": {"a": "b"}}, timeout_s=1.0)
    assert isinstance(config.timeout_s, float)
    with pytest.raises(ConfigError, match=r"^rollout.env.max_turns must be an int >= 1, got 0$"):
        from_dict(EnvConfig, {"name": "calculator", "max_turns": 0}, "rollout.env")
    with pytest.raises(ConfigError, match=r"missing required config key\(s\): rollout.env.name"):
        from_dict(EnvConfig, {}, "rollout.env")


def test_tool_spec_and_tool_episode():
    assert GUESS.schema() == {"type": "function", "function": {
        "name": "guess", "description": "guess the secret number", "parameters": GUESS.parameters}}
    assert (GUESS.required, GUESS.properties) == (["number"], ["number"])
    with pytest.raises(ValueError, match="ToolSpec.name must be a non-empty string"):
        ToolSpec(" guess", "x")
    with pytest.raises(ValueError, match="parameters must be a JSON schema of type 'object'"):
        ToolSpec("guess", "x", {"type": "string"})
    with pytest.raises(ValueError, match=r"tools \['guess'\] and functions \['other'\] must name the same tools"):
        ToolEpisode([GUESS], {"other": str})

    def guess(number):
        if number < 0:
            raise ToolError("the number must be >= 0")
        return f"you said {number}"

    episode = ToolEpisode([GUESS], {"guess": guess})
    assert episode.step([], ParsedCall("guess", {"number": 4})) == StepResult("you said 4")
    assert episode.step([], ParsedCall("guess", {"number": -1})) == StepResult(
        "error: the number must be >= 0", info={"tool_error": "the number must be >= 0"})


def test_timeouts_have_an_upper_bound():
    """A timeout past threading.TIMEOUT_MAX raised OverflowError inside the pool at the first call; any
    timeout over an hour is refused when the config is read, naming the key."""
    from megarlhf.config.rollout import EnvConfig
    from megarlhf.config.reward import RewardConfig, RewardSpec

    with pytest.raises(ValueError, match=r"EnvConfig.timeout_s must be a finite number in \(0, 3600\] seconds"):
        EnvConfig("calculator", timeout_s=1e300)
    with pytest.raises(ValueError, match=r"RewardConfig.timeout_s must be a finite number in \(0, 3600\]"):
        RewardConfig(functions=[RewardSpec("exact_match")], timeout_s=1e300)


def test_tool_describer_gives_the_episode_tools_and_the_format():
    from megarlhf.envs.prompting import tool_describer

    assert tool_describer(EnvConfig("calculator", describe_tools=False), None) is None
    description = tool_describer(EnvConfig("calculator", parser="hermes"), None)({})
    [schema] = description.schemas
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert json.dumps(schema) in description.text and "<tool_call>" in description.text
