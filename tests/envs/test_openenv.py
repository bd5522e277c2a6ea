"""The ``openenv`` environment against real OpenEnv 0.10 servers (examples/openenv, served from .venv-openenv
as OpenEnv serves them) and against a hostile server: tools, steps, rewards, the final answer, sessions
closed, a server that dies restarted, and every bad reply an episode's outcome, never the run's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http import HTTPStatus
from pathlib import Path

import pytest
from websockets.sync.server import serve

from megarlhf.config.rollout import EnvConfig
from megarlhf.core.errors import ConfigError
from megarlhf.envs import openenv_server
from megarlhf.envs.api import ToolSpec
from megarlhf.envs.openenv import openenv_env
from megarlhf.envs.runner import ToolRunner

ROOT = Path(__file__).resolve().parents[2]
SERVER_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
EXAMPLES = ROOT / "examples" / "openenv"


def _command(app: str) -> list[str]:
    return [str(SERVER_PYTHON), "-m", "uvicorn", app, "--app-dir", str(EXAMPLES), "--port", "{port}"]


@pytest.fixture(scope="module", autouse=True)
def openenv_venv():
    if not SERVER_PYTHON.exists():
        pytest.fail("OpenEnv's environment is missing: `make setup-openenv` (make test runs it) creates .venv-openenv")
    yield
    openenv_server.stop_servers()


def _turn(text: str) -> list[dict]:
    return [{"role": "user", "content": "What is 97 + 71?"}, {"role": "assistant", "content": text}]


def _call(name: str, arguments: dict) -> list[dict]:
    return _turn(f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>')


def test_an_action_environment_scores_calls_and_final_answers():
    config = EnvConfig("openenv", {"command": _command("sums_env.server.app:app"), "tool_name": "submit",
                                   "answer_field": "answer"}, parser="hermes", max_turns=2)
    runner = ToolRunner(config)
    handles = runner.start([{"ground_truth": "168", "expression": "97 + 71"}] * 4)
    assert handles[0].episode.tools == [ToolSpec("submit", "The model's final answer, as it wrote it.", {
        "additionalProperties": False, "type": "object", "required": ["answer"],
        "properties": {"answer": {"description": "your final answer", "title": "Answer", "type": "string"}}})]
    batch = runner.step(handles, [_turn("97 + 71 = 168. The answer is 168."), _turn("The answer is 170."),
                                  _call("submit", {"answer": "168"}), _call("submit", {"answer": 168})])
    right, wrong, called, invalid = batch.outcomes
    assert (right.observation, right.done, right.reward, right.answered) == (None, True, 1.0, True)
    assert (wrong.observation, wrong.done, wrong.reward) == (None, True, 0.0)
    assert (called.observation, called.done, called.reward) == ("correct", True, 1.0)
    assert invalid.observation == "error: Invalid message (answer: Input should be a valid string)"
    assert (invalid.done, invalid.reward, batch.failures) == (False, None, [])
    assert batch.metrics["tools/answers"] == 2.0 and batch.metrics["tools/refused"] == 1.0
    assert [h.episode.session is None for h in handles] == [True, True, True, False]  # closed when done
    runner.finish(handles)
    assert all(h.episode.session is None for h in handles)
    runner.close()


def test_an_mcp_environment_offers_its_tools_and_runs_them():
    port = openenv_server._free_port()
    server = subprocess.Popen(_command("calculator_env.server.app:app")[:-1] + [str(port)], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not openenv_server.OpenEnvServer(openenv_server.ServerSettings(url, None, 1, 1, 1))._healthy(1):
            assert time.monotonic() < deadline and server.poll() is None, "the calculator server did not start"
            time.sleep(0.2)
        runner = ToolRunner(EnvConfig("openenv", {"url": url, "mode": "mcp"}, parser="hermes"))
        handles = runner.start([{}] * 3)
        assert handles[0].episode.tools == [ToolSpec("calculator", "Evaluate an arithmetic expression.", {
            "additionalProperties": False, "properties": {"expression": {"type": "string"}},
            "required": ["expression"], "type": "object"})]
        batch = runner.step(handles, [_call("calculator", {"expression": "(97 + 71) * 2"}),
                                      _call("calculator", {"expression": "__import__('os')"}),
                                      _turn("The answer is 168.")])
        assert [o.observation for o in batch.outcomes] == [
            "336", "error: Error calling tool 'calculator': only numbers, + - * / and parentheses are allowed", None]
        assert [o.done for o in batch.outcomes] == [False, False, True] and batch.metrics["tools/answers"] == 0.0
        runner.finish(handles)
        runner.close()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_a_server_that_dies_fails_its_calls_and_is_restarted_for_the_next_batch():
    config = EnvConfig("openenv", {"command": _command("sums_env.server.app:app"), "tool_name": "submit",
                                   "answer_field": "answer", "timeout_s": 5}, parser="hermes")
    runner = ToolRunner(config)
    handles = runner.start([{"ground_truth": "1"}] * 2)
    server = handles[0].episode.server
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    batch = runner.step(handles, [_call("submit", {"answer": "1"}), _turn("The answer is 1.")])
    assert [f.kind for f in batch.failures] == ["error", "error"]
    assert "could not open a session" in batch.outcomes[0].observation and batch.outcomes[1].reward is None
    handles = runner.start([{"ground_truth": "1"}])  # the next batch: the command runs again
    assert server.restarts == 1
    assert runner.step(handles, [_turn("The answer is 1.")]).outcomes[0].reward == 1.0
    runner.finish(handles)
    runner.close()


class HostileServer:
    """Serves /health, /schema and /ws; each step's reply is what its action's ``answer`` asks for."""

    REPLIES = {
        "text": lambda ws: ws.send("not json"),
        "list": lambda ws: ws.send("[1, 2]"),
        "nan": lambda ws: ws.send('{"type": "observation", "data": {"observation": {"x": "y"}, "reward": NaN}}'),
        "done": lambda ws: ws.send('{"type": "observation", "data": {"observation": {"x": "y"}, "done": "yes"}}'),
        "huge": lambda ws: ws.send("x" * (2 << 20)),
        "error": lambda ws: ws.send('{"type": "error", "data": {"message": "boom", "code": "EXECUTION_ERROR"}}'),
        "close": lambda ws: ws.close(),
        "silent": lambda ws: time.sleep(3),
        "fine": lambda ws: ws.send('{"type": "observation", "data": {"observation": {"n": 1, "s": "\\udc80"}, '
                                   '"reward": true, "done": false}}'),
    }

    def __init__(self):
        self.open = 0
        self.server = serve(self.handle, "127.0.0.1", 0, process_request=self.http)
        self.url = f"http://127.0.0.1:{self.server.socket.getsockname()[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def http(self, connection, request):
        if request.path == "/health":
            return connection.respond(HTTPStatus.OK, "{}")
        if request.path == "/schema":
            schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
            return connection.respond(HTTPStatus.OK, json.dumps({"action": schema}))
        if request.path == "/metadata":
            return connection.respond(HTTPStatus.OK, '{"description": "answers as it likes"}')
        return None

    def handle(self, ws):
        self.open += 1
        try:
            for raw in ws:  # ends when the client closes, also on a frame too big for it
                message = json.loads(raw)
                if message["type"] == "reset":
                    ws.send('{"type": "observation", "data": {"observation": {}, "done": false}}')
                elif message["type"] == "step":
                    self.REPLIES[message["data"]["answer"]](ws)
                else:
                    break
        finally:
            self.open -= 1


def test_whatever_a_server_answers_is_an_episode_outcome_never_a_crash(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a proxy for the world must not come between
    hostile = HostileServer()
    config = EnvConfig("openenv", {"url": hostile.url, "timeout_s": 1, "max_message_mb": 1},
                       parser="hermes", timeout_s=10, num_workers=9)
    runner = ToolRunner(config)
    kinds = list(HostileServer.REPLIES)
    handles = runner.start([{}] * len(kinds))
    batch = runner.step(handles, [_call("step", {"answer": kind}) for kind in kinds])
    shown = dict(zip(kinds, (o.observation for o in batch.outcomes)))
    assert shown["fine"] == '{"n": 1, "s": "\\udc80"}' and batch.outcomes[-1].reward == 1.0
    assert sorted(f.index for f in batch.failures) == list(range(len(kinds) - 1))
    assert "non-JSON 'not json'" in shown["text"] and "not an observation" in shown["list"]
    assert "reward is not a finite number" in shown["nan"] and "not an OpenEnv step result" in shown["done"]
    assert "message too big" in shown["huge"] and "the environment failed the step: boom" in shown["error"]
    assert "session broke" in shown["close"] and "did not answer a 'step' within 1.0 s" in shown["silent"]
    again = runner.step([handles[kinds.index("silent")], handles[kinds.index("error")]],
                        [_call("step", {"answer": "fine"})] * 2).outcomes
    assert "session was lost earlier (the server did not answer a 'step' within 1.0 s)" in again[0].observation
    assert again[1].observation == shown["fine"]  # an environment that raised in a step keeps its session
    runner.finish(handles)
    deadline = time.monotonic() + 10
    while hostile.open and time.monotonic() < deadline:  # the silent handler wakes after 3 s
        time.sleep(0.1)
    assert hostile.open == 0
    runner.close()
    hostile.server.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    ({}, "needs exactly one of rollout.env.kwargs.url"),
    ({"url": "ftp://x"}, "url must be an http:// or https:// URL"),
    ({"command": ["python", "-m", "server"]}, r"with a '\{port\}' placeholder"),
    ({"url": "http://127.0.0.1:9", "mode": "gym"},
     r"mode of the openenv environment must be one of \['action', 'mcp'\]"),
    ({"url": "http://127.0.0.1:9", "mode": "mcp", "answer_field": "a"}, "answer_tool of the openenv environment names"),
    ({"url": "http://127.0.0.1:9", "timeout_s": 0}, "timeout_s must be a positive number"),
    ({"url": "http://127.0.0.1:9", "timeout_s": 1}, r"no OpenEnv server answers at http://127\.0\.0\.1:9/health"),
    ({"command": [sys.executable, "-c", "print('cannot serve {port}'); raise SystemExit(3)"]},
     r"exited with code 3 before serving; its output ends: 'cannot serve \d+\\n'"),
    ({"command": [sys.executable, "-c", "import time; print('starting {port}', flush=True); time.sleep(60)"],
      "start_timeout_s": 1},
     r"did not answer at http://127\.0\.0\.1:\d+/health within start_timeout_s=1\.0; its output ends: 'starting \d+"),
    ({"url": "http://127.0.0.1:9", "max_message_mb": 0.5}, r"max_message_mb must be an int in \[1, 1024\]"),
    ({"url": "http://127.0.0.1:9", "observation_field": 3}, r"observation_field of the openenv environment must be a "
                                                            r"non-empty string or null, got 3"),
    ({"url": "http://127.0.0.1:9", "answr_field": "a"}, r"unknown key\(s\) \['answr_field'\]; known: \['url', "),
])
def test_bad_settings_and_unreachable_servers_stop_the_run_at_start_up(kwargs, message):
    with pytest.raises((ValueError, ConfigError), match=message):
        openenv_env({}, **kwargs)


def test_settings_that_do_not_fit_the_server_and_a_closed_episode():
    hostile = HostileServer()
    with pytest.raises(ConfigError, match=r"answer_field 'text' must be the one required \(string\) field of the "
                                          r"action \(its fields: \['answer'\], required: \['answer'\]\)"):
        openenv_env({}, url=hostile.url, answer_field="text")
    with pytest.raises(ValueError, match=r"reset_fields names \['level'\], which the row does not have"):
        openenv_env({"ground_truth": "1"}, url=hostile.url, reset_fields=["level"])
    episode = openenv_env({}, url=hostile.url, answer_field="answer")
    episode.close()  # the rollout ended while a timed-out call had not yet opened the session
    with pytest.raises(Exception, match="the episode was closed"):
        episode.final_answer([{"role": "assistant", "content": "fine"}])
    assert hostile.open == 0
    hostile.server.shutdown()
