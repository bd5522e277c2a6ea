"""ToolRunner: a raising tool, a hanging tool (the step returns at the timeout and later calls still
work), a non-string observation, a too-long observation, parse errors, answers, max_turns, and metrics."""
from __future__ import annotations

import json
import time

import pytest

from megarlhf.config.rollout import EnvConfig
from megarlhf.envs import ParsedCall, ParseError, StepResult, ToolEpisode, ToolRunner, ToolSpec
from megarlhf.envs.api import stateless
from megarlhf.testing.hostile import alive, live_children, misbehave


def _tool(name: str, *arguments: str) -> ToolSpec:
    return ToolSpec(name, f"test tool {name}", {"type": "object", "required": list(arguments),
                                                "properties": {a: {"type": "string"} for a in arguments}})


def _boom():
    raise RuntimeError("kaboom")


def _hang():
    time.sleep(10)
    return "woke up"


FUNCTIONS = {"echo": lambda text: text, "boom": _boom, "hang": _hang, "number": lambda: 42,
             "long": lambda: "x" * 5000}


def scripted_tools(metadata, greeting="hi"):
    """A user environment named by dotted path: stateless test tools."""
    tools = [_tool("echo", "text"), _tool("boom"), _tool("hang"), _tool("number"), _tool("long")]
    return ToolEpisode(tools, FUNCTIONS)


class Finisher:
    """Ends the episode with a reward and no observation when 'finish' is called."""

    tools = [_tool("finish")]

    def __init__(self, metadata):
        self.reward = metadata["reward"]

    def step(self, messages, call):
        return StepResult(None, done=True, reward=self.reward, info={"turns_seen": len(messages)})


HERE = __name__


def _call(name: str, arguments: str = "{}") -> list[dict]:
    turn = f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'
    return [{"role": "user", "content": "go"}, {"role": "assistant", "content": turn}]


@pytest.fixture
def runner():
    config = EnvConfig(f"{HERE}:scripted_tools", timeout_s=0.2, max_observation_chars=100, max_turns=3,
                       parser="hermes", num_workers=2)
    runner = ToolRunner(config)
    yield runner
    runner.close()


def test_a_batch_of_every_kind(runner):
    handles = runner.start([{}] * 6)
    conversations = [_call("echo", '{"text": "hello"}'), _call("boom"), _call("number"), _call("long"),
                     _call("nope"), [{"role": "assistant", "content": "The answer is 4."}]]
    batch = runner.step(handles, conversations)
    echo, boom, number, long, nope, answer = batch.outcomes
    assert (echo.observation, echo.done, echo.reward, echo.call) == ("hello", False, None, ParsedCall("echo", {"text": "hello"}))
    assert boom.observation == "error: tool 'boom' raised RuntimeError: kaboom" and not boom.done
    assert number.observation == "error: tool 'number' returned an observation of type int, expected a string"
    marker = " ...[cut: 5000 chars]"
    assert long.observation == "x" * (100 - len(marker)) + marker and len(long.observation) == 100
    assert long.info == {"truncated_from": 5000}
    assert nope.observation == "error: unknown tool 'nope'; available tools: boom, echo, hang, long, number"
    assert nope.call == ParseError("unknown tool 'nope'; available tools: boom, echo, hang, long, number")
    assert (answer.observation, answer.done, answer.call) == (None, True, None)
    assert [(f.index, f.tool, f.kind) for f in batch.failures] == [(1, "boom", "error"), (2, "number", "invalid")]
    assert batch.failures[0].turn == conversations[1][-1]["content"]
    assert batch.metrics == {"tools/calls": 4.0, "tools/errors": 2.0, "tools/timeouts": 0.0, "tools/parse_errors": 1.0,
                             "tools/refused": 0.0, "tools/truncated": 1.0, "tools/abandoned_threads": 0.0,
                             "tools/answers": 0.0, "tools/not_run": 0.0, "tools/killed_workers": 0.0}
    assert [h.done for h in handles] == [False] * 5 + [True]
    with pytest.raises(ValueError, match="the episode of sample 5 is done"):
        runner.step(handles[5:], [_call("echo", '{"text": "again"}')])


def test_a_hanging_tool_times_out_and_the_rest_carries_on(runner):
    handles = runner.start([{}] * 3)
    start = time.monotonic()
    batch = runner.step(handles[:2], [_call("hang"), _call("echo", '{"text": "meanwhile"}')])
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 1.5, elapsed  # the timeout, not the tool's 10 s
    hang, echo = batch.outcomes
    assert hang.observation == "error: the call of tool 'hang' timed out after 0.2 s" and not hang.done
    assert hang.info == {"failure": "timeout"} and echo.observation == "meanwhile"
    assert [(f.index, f.kind) for f in batch.failures] == [(0, "timeout")]
    assert batch.metrics["tools/timeouts"] == 1.0 and batch.metrics["tools/errors"] == 0.0
    assert batch.metrics["tools/abandoned_threads"] == 1.0

    start = time.monotonic()  # later calls: a fresh worker took the stuck one's place
    batch = runner.step(handles, [_call("echo", '{"text": "busy?"}'), _call("echo", '{"text": "a"}'),
                                  _call("echo", '{"text": "b"}')])
    assert time.monotonic() - start < 0.5
    busy, a, b = batch.outcomes
    assert busy.observation == "error: the previous tool call of this episode is still running"
    assert (a.observation, b.observation) == ("a", "b")
    assert [(f.index, f.kind) for f in batch.failures] == [(0, "busy")]
    assert batch.metrics["tools/errors"] == 1.0 and batch.metrics["tools/calls"] == 3.0


def test_max_turns_ends_the_episode_without_running_the_last_turns_call(runner):
    """The model has no turn left to read the last turn's result: that call is not run (no side effect, no
    reward), reported as not run."""
    (handle,) = runner.start([{}])
    for turn in range(1, 4):
        batch = runner.step([handle], [_call("echo", f'{{"text": "{turn}"}}')])
        outcome = batch.outcomes[0]
        assert outcome.done == (turn == 3)
        assert outcome.observation == (None if turn == 3 else str(turn))
        assert batch.metrics["tools/calls"] == float(turn < 3) and batch.metrics["tools/not_run"] == float(turn == 3)
    assert outcome.call == ParsedCall("echo", {"text": "3"}) and outcome.info == {"not_run": "max_turns"}
    assert handle.turns == 3 and handle.done
    finisher = ToolRunner(EnvConfig(f"{HERE}:Finisher", parser="hermes", max_turns=1))
    outcome = finisher.step(finisher.start([{"reward": 1.5}]), [_call("finish")]).outcomes[0]
    assert (outcome.observation, outcome.done, outcome.reward) == (None, True, None)  # its reward does not count
    finisher.close()


def test_an_environment_that_finishes_with_a_reward():
    runner = ToolRunner(EnvConfig(f"{HERE}:Finisher", parser="hermes"))
    handles = runner.start([{"reward": 1.5}, {"reward": -2}])
    batch = runner.step(handles, [_call("finish"), _call("finish")])
    assert [(o.observation, o.done, o.reward, o.info) for o in batch.outcomes] == [
        (None, True, 1.5, {"turns_seen": 2}), (None, True, -2.0, {"turns_seen": 2})]
    assert batch.failures == []
    runner.close()


class Invalid:
    tools = [_tool("go")]

    def __init__(self, metadata):
        self.result = metadata["result"]

    def step(self, messages, call):
        return self.result


@pytest.mark.parametrize("result, message", [
    ("text", "returned str, expected a StepResult"),
    (StepResult(None, done=False), "returned no observation without ending the episode"),
    (StepResult("ok", done=1), "returned done=1, expected a bool"),
    (StepResult("ok", reward=float("nan")), "returned reward=nan, expected a finite number or None"),
    (StepResult("ok", info=[]), "returned info of type list, expected a dict"),
])
def test_invalid_step_results_are_reported(result, message):
    runner = ToolRunner(EnvConfig(f"{HERE}:Invalid", parser="hermes"))
    batch = runner.step(runner.start([{"result": result}]), [_call("go")])
    assert batch.outcomes[0].observation == f"error: tool 'go' {message}"
    assert [(f.kind, f.message) for f in batch.failures] == [("invalid", f"tool 'go' {message}")]
    runner.close()


def test_bad_use_is_an_error_naming_the_sample(runner):
    with pytest.raises(ValueError, match=r"could not start the episode of sample 1: KeyError: 'reward'"):
        ToolRunner(EnvConfig(f"{HERE}:Finisher")).start([{"reward": 1}, {}])
    with pytest.raises(ValueError, match=r"could not start the episode of sample 0: TypeError: .*unexpected keyword"):
        ToolRunner(EnvConfig(f"{HERE}:scripted_tools", kwargs={"colour": "red"})).start([{}])
    handles = runner.start([{}, {}])
    with pytest.raises(ValueError, match="the conversation of sample 1 must end with the model's turn"):
        runner.step(handles, [_call("echo", '{"text": "x"}'), [{"role": "user", "content": "hi"}]])
    assert [h.turns for h in handles] == [0, 0]  # a bad batch changes no episode
    with pytest.raises(ValueError, match="step got 2 episodes, 1 conversations and 2 final flags"):
        runner.step(handles, [_call("echo", '{"text": "x"}')])


def test_calculator_end_to_end_with_the_tokenizer_parser():
    runner = ToolRunner(EnvConfig("calculator", max_observation_chars=40))
    handles = runner.start([{}, {}, {}])
    batch = runner.step(handles, [_call("calculator", '{"expression": "6 * 7"}'),
                                  _call("calculator", '{"expression": "1/0"}'),
                                  _call("calculator", '{"expression": "7**100"}')])
    assert [o.observation for o in batch.outcomes] == [
        "42", "error: division by zero", str(7 ** 100)[:40 - 19] + " ...[cut: 85 chars]"]  # the marker has 19 chars
    assert batch.metrics["tools/refused"] == 1.0 and batch.metrics["tools/truncated"] == 1.0
    runner.close()


# ---- stateless environments: their calls run in worker processes the runner kills -------------------------
def _act(what):
    """Misbehaves as ``what`` says (megarlhf.testing.hostile); answers "fine" otherwise."""
    import os

    if what == "pid":
        return str(os.getpid())
    elif what == "huge":  # ~2.4 MB of JSON: more than a reply frame may carry, unless cut first
        return "\u4e00" * 400_000
    allocated = misbehave(what)
    return "fine" if allocated is None else str(allocated)


@stateless
def hostile_tools(metadata):
    """A stateless user environment (dotted path) whose one tool misbehaves on request; ``info`` carries
    the row's metadata, which the worker only knows from the call it was sent."""
    episode = ToolEpisode([_tool("act", "what")], {"act": _act})
    step = episode.step

    def step_with_row(messages, call):
        result = step(messages, call)
        result.info["row"] = metadata["row"]
        if call.arguments["what"] == "unjsonable":
            result.info["set"] = {1}
        return result

    episode.step = step_with_row
    return episode


def _acts(*whats):
    return [_call("act", json.dumps({"what": w})) for w in whats]


def _worker_pids(runner) -> set[int]:
    return {worker.process.pid for worker in runner.processes._workers}


def test_stateless_tools_run_in_worker_processes_that_are_killed_in_bounded_time():
    timeout = 1.0
    runner = ToolRunner(EnvConfig(f"{HERE}:hostile_tools", timeout_s=timeout, parser="hermes", num_workers=2,
                                  worker_memory_mb=1024))
    [handle] = runner.start([{"row": 7}])
    [outcome] = runner.step([handle], _acts("pid")).outcomes
    assert int(outcome.observation) in _worker_pids(runner) and outcome.info == {"row": 7}
    first = _worker_pids(runner)
    whats = ["regex", "fine", "hang", "spin", "segfault", "exit", "memory", "unjsonable", "fine"]
    handles = runner.start([{"row": i} for i in range(len(whats))])
    start = time.monotonic()
    batch = runner.step(handles, _acts(*whats))
    # 3 calls time out (1 s each) on 2 workers, and every killed worker is restarted (~0.5 s each)
    assert time.monotonic() - start < 3 * timeout + 6 * 2.0
    assert [o.observation for o in batch.outcomes if "failure" not in o.info] == ["fine", "fine"]
    kinds = {f.index: f.kind for f in batch.failures}
    assert kinds == {0: "timeout", 2: "timeout", 3: "timeout", 4: "error", 5: "error", 6: "error", 7: "error"}
    messages = {f.index: f.message for f in batch.failures}
    assert "died during the call" in messages[4] and "exit code 3" in messages[5]
    assert "MemoryError" in messages[6]  # the address-space limit: the worker survives and reports it
    assert "not JSON serializable" in messages[7]
    assert batch.outcomes[2].observation == "error: the call of tool 'act' timed out after 1.0 s"
    assert batch.metrics["tools/killed_workers"] == 5.0 and batch.metrics["tools/timeouts"] == 3.0
    assert batch.metrics["tools/abandoned_threads"] == 0.0
    assert not any(alive(pid) for pid in first - _worker_pids(runner))  # killed workers are gone
    again = runner.start([{"row": 1}, {"row": 2}])
    assert [o.observation for o in runner.step(again, _acts("fine", "fine")).outcomes] == ["fine", "fine"]
    runner.close()
    assert not any(alive(pid) for pid in _worker_pids(runner))


@pytest.mark.slow  # ~25 s: every timed-out worker is replaced by a fresh interpreter
def test_a_hundred_hanging_tool_calls_leave_nothing_behind():
    """The 4 workers time out and are replaced side by side: the hundred calls (25 rounds of 4) take at most twice
    12.5 times what 8 calls (2 rounds, a replacement between) take on this machine, measured first; run one at a
    time they would take 50 times as long. (A fixed bound of 2 s per replacement failed on a loaded CI machine,
    where a fresh interpreter took longer.)"""
    import threading

    threads, children = threading.active_count(), len(live_children())
    runner = ToolRunner(EnvConfig(f"{HERE}:hostile_tools", timeout_s=0.3, parser="hermes", num_workers=4))
    start = time.monotonic()
    runner.step(runner.start([{"row": -k} for k in range(1, 9)]), _acts(*["hang"] * 8))
    two_rounds = time.monotonic() - start
    start = time.monotonic()
    batch = runner.step(runner.start([{"row": i} for i in range(100)]), _acts(*["hang"] * 100))
    assert batch.metrics["tools/timeouts"] == 100.0
    assert batch.metrics["tools/killed_workers"] == 108.0  # since the start: the first 8 calls' workers too
    assert time.monotonic() - start < 2 * 12.5 * two_rounds, two_rounds
    assert threading.active_count() <= threads  # none abandoned, none started for calls that run in processes
    assert len(live_children()) <= children + 4  # the 4 live workers
    runner.close()
    deadline = time.monotonic() + 5.0
    while len(live_children()) > children and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(live_children()) == children and threading.active_count() <= threads


def test_built_in_environments_are_stateless_and_user_ones_keep_their_state_in_process():
    from megarlhf.envs import ENVIRONMENTS
    from megarlhf.envs.api import is_stateless

    assert all(is_stateless(ENVIRONMENTS.get(name)) for name in ("calculator", "lookup", "code"))
    assert not ToolRunner(EnvConfig(f"{HERE}:Finisher")).stateless


def test_a_stateless_environment_starts_no_threads():
    import threading

    threads = threading.active_count()
    runner = ToolRunner(EnvConfig(f"{HERE}:hostile_tools", parser="hermes", num_workers=4))
    assert [o.observation for o in runner.step(runner.start([{"row": 0}]), _acts("fine")).outcomes] == ["fine"]
    assert threading.active_count() == threads  # its calls run in worker processes
    runner.close()


def test_a_long_observation_is_cut_in_the_worker_not_lost_with_it():
    runner = ToolRunner(EnvConfig(f"{HERE}:hostile_tools", parser="hermes", max_observation_chars=50))
    [outcome] = runner.step(runner.start([{"row": 0}]), _acts("huge")).outcomes
    assert len(outcome.observation) == 50 and outcome.observation.endswith("...[cut: 400000 chars]")
    assert outcome.info == {"row": 0, "truncated_from": 400_000} and runner.processes.killed == 0
    runner.close()


def test_a_stateless_environment_whose_workers_cannot_start_is_refused_when_the_runner_is_made():
    from megarlhf.envs import ENVIRONMENTS
    from megarlhf.core.errors import ConfigError

    ENVIRONMENTS.register("made_at_run_time")(stateless(hostile_tools))  # unknown in a fresh interpreter
    try:
        with pytest.raises(ConfigError, match=r"environment 'made_at_run_time' is declared stateless, so its calls "
                                              r"run in worker processes, but the worker process could not start: "
                                              r".*unknown environment 'made_at_run_time'"):
            ToolRunner(EnvConfig("made_at_run_time", parser="hermes"))
    finally:
        ENVIRONMENTS._entries.pop("made_at_run_time", None)


class HugeReward:
    """Rewards every call with an int too large for a float."""

    tools = [_tool("finish")]

    def __init__(self, metadata):
        pass

    def step(self, messages, call):
        return StepResult("ok", reward=10**5000)


def test_an_integer_reward_too_large_for_a_float_is_an_invalid_result():
    # float() of such an int raises OverflowError and its repr ValueError: the result check crashed the rollout
    runner = ToolRunner(EnvConfig(f"{HERE}:HugeReward", parser="hermes"))
    batch = runner.step(runner.start([{}]), [_call("finish")])
    assert [f.kind for f in batch.failures] == ["invalid"] and "reward=an int of more than" in batch.failures[0].message
    runner.close()
