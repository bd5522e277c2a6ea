"""The ``openenv`` environment: episodes of an OpenEnv environment server, run unchanged.

An OpenEnv environment (OpenEnv 0.10: an ``Environment`` subclass with ``reset``/``step`` and pydantic
``Action``/``Observation`` models, served by ``create_app``) runs in its own server process, as OpenEnv
runs them (Docker, ``uv run``); megarlhf is a client of the server's WebSocket session protocol
(``/ws``: ``reset``, ``step``, ``close`` messages; one environment instance per connection) and never
imports ``openenv``, which does not install next to the pinned stack (it needs httpx >= 0.28.1, nemo_run's
leptonai pins 0.27.2). Recipe::

    rollout:
      env:
        name: openenv
        kwargs:
          url: http://127.0.0.1:8011          # a running server, or
          command: [.venv-openenv/bin/python, -m, uvicorn, sums_env.server.app:app,
                    --app-dir, examples/openenv, --port, "{port}"]   # started by each process that runs episodes
          mode: action                        # or mcp
          answer_field: answer                # optional: the final answer goes to the environment

Two kinds of environment (``mode``):

* ``action``: the environment's ``Action`` model is one tool, named ``tool_name``, whose parameters are the
  action's JSON schema (``/schema``, without its ``metadata``); a call of it is one ``step``.
* ``mcp``: an ``MCPEnvironment``; its MCP tools (one ``list_tools`` per server, so they must not depend on
  the episode) are the tools, a call of one is a ``call_tool`` step.

A model turn without a tool call is the episode's final answer. With ``answer_field`` set, it is sent to the
environment (``action``: ``{answer_field: text}`` as a step; ``mcp``: a call of ``answer_tool`` with
``{answer_field: text}``) and the step's reward counts; the episode ends there whatever the step says.

An episode resets its environment when it first needs it, with the dataset row's fields (``reset_fields``,
default all) as ``reset``'s keyword arguments (the server passes those its ``reset`` accepts). Rewards are
the steps' ``reward``, ``done`` ends the episode. An observation is shown as ``observation_field``'s value,
else the observation's one text field, else its fields as JSON; an MCP call as its result's text, a tool's
error as ``"error: ..."``. An action the server rejects (the model's arguments do not validate) is shown as
an error; a server that closes the connection, answers something that is not its protocol, or does not
answer within ``timeout_s`` fails that call (the runner counts and shows it); the run goes on.
"""
from __future__ import annotations

import json
import math
from typing import Any

from megarlhf.envs.api import ENVIRONMENTS, Message, ParsedCall, StepResult, ToolSpec
from megarlhf.envs.openenv_server import OpenEnvProtocolError, ServerSettings, server_for

_MODES = ("action", "mcp")
_SHOWN = 300  # characters of a server's reply quoted in an error


def _settings_error(key: str, why: str) -> ValueError:
    return ValueError(f"rollout.env.kwargs.{key} of the openenv environment {why}")


class OpenEnvEpisode:
    """One sample's session with an OpenEnv server (see the module docstring)."""

    def __init__(self, metadata: dict[str, Any], server: Any, mode: str, tool_name: str, answer_field: str | None,
                 answer_tool: str | None, reset_fields: list[str] | None, observation_field: str | None):
        self.server, self.mode, self.tool_name = server, mode, tool_name
        self.answer_field, self.answer_tool, self.observation_field = answer_field, answer_tool, observation_field
        fields = metadata if reset_fields is None else {k: metadata[k] for k in reset_fields if k in metadata}
        self.reset_data = dict(fields)
        self.tools = server.tools(mode, tool_name)
        self.session = None  # opened at the first step: describing the tools of a row needs no session

    def step(self, messages: list[Message], call: ParsedCall) -> StepResult:
        if self.mode == "mcp":
            return self._act({"type": "call_tool", "tool_name": call.name, "arguments": call.arguments})
        if call.name != self.tool_name:
            return _refused(f"unknown tool {call.name!r}; the tool is {self.tool_name!r}")
        return self._act(dict(call.arguments))

    def answer(self, messages: list[Message]) -> StepResult | None:
        """The final answer (a turn without a tool call) as a step, when ``answer_field`` is set."""
        if self.answer_field is None:
            return None
        text = messages[-1]["content"]
        if self.mode == "mcp":
            action = {"type": "call_tool", "tool_name": self.answer_tool, "arguments": {self.answer_field: text}}
        else:
            action = {self.answer_field: text}
        result = self._act(action)
        return StepResult(None, True, result.reward, result.info)

    def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            session.close()

    def _act(self, action: dict[str, Any]) -> StepResult:
        if self.session is None:
            self.session = self.server.session()
            self.session.request("reset", self.reset_data)
        reply = self.session.request("step", action)
        if reply["kind"] == "refused":
            return _refused(reply["message"])
        return self._result(reply["data"])

    def _result(self, data: dict[str, Any]) -> StepResult:
        observation, reward, done = data.get("observation"), data.get("reward"), data.get("done", False)
        if not isinstance(observation, dict) or not isinstance(done, bool):
            raise OpenEnvProtocolError(f"the server's observation is not an OpenEnv step result: {_quoted(data)}")
        if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            raise OpenEnvProtocolError(f"the server's reward is not a finite number: {_quoted(reward)}")
        reward = None if reward is None else float(reward)
        if self.mode == "mcp" and "tool_name" in observation:
            text, error = _tool_text(observation)
            if error is not None:
                return StepResult(f"error: {error}", done, reward, {"tool_error": error})
        else:
            text = self._observation_text(observation)
        return StepResult(text, done, reward)

    def _observation_text(self, observation: dict[str, Any]) -> str:
        fields = {k: v for k, v in observation.items() if k != "metadata"}
        if self.observation_field is not None:
            if self.observation_field not in fields:
                raise OpenEnvProtocolError(f"the observation has no field {self.observation_field!r} "
                                           f"(rollout.env.kwargs.observation_field): {_quoted(observation)}")
            value = fields[self.observation_field]
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
            return next(iter(fields.values()))
        return json.dumps(fields, ensure_ascii=False)


def _refused(message: str) -> StepResult:
    return StepResult(f"error: {message}", info={"tool_error": message})


def _tool_text(observation: dict[str, Any]) -> tuple[str, str | None]:
    """An MCP call's (result text, error message or None)."""
    error = observation.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else None
        return "", message if isinstance(message, str) else _quoted(error)
    result = observation.get("result")
    if isinstance(result, dict):
        if isinstance(result.get("data"), str):
            return result["data"], None
        content = result.get("content")
        if isinstance(content, list) and content and all(isinstance(c, dict) and isinstance(c.get("text"), str)
                                                         for c in content):
            text = "\n".join(c["text"] for c in content)
            return text, (text if result.get("is_error") is True else None)
    return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)), None


def _quoted(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=repr)
    return repr(text[:_SHOWN]) + ("..." if len(text) > _SHOWN else "")


@ENVIRONMENTS.register("openenv")
def openenv_env(metadata: dict, url: str | None = None, command: list[str] | None = None, mode: str = "action",
                tool_name: str = "step", answer_field: str | None = None, answer_tool: str | None = None,
                reset_fields: list[str] | None = None, observation_field: str | None = None,
                timeout_s: float = 30.0, start_timeout_s: float = 120.0,
                max_message_mb: int = 16) -> OpenEnvEpisode:
    """An episode of the OpenEnv server at ``url``, or of the one ``command`` starts (see the module docstring)."""
    if mode not in _MODES:
        raise _settings_error("mode", f"must be one of {list(_MODES)}, got {mode!r}")
    if not (isinstance(tool_name, str) and tool_name):
        raise _settings_error("tool_name", f"must be a non-empty string, got {tool_name!r}")
    if answer_field is not None and not (isinstance(answer_field, str) and answer_field):
        raise _settings_error("answer_field", f"must be a non-empty string or null, got {answer_field!r}")
    if (mode == "mcp" and answer_field is not None) != (answer_tool is not None):
        raise _settings_error("answer_tool", "names the MCP tool the final answer goes to: it is needed with "
                              "answer_field in mcp mode and only there")
    if reset_fields is not None and not (isinstance(reset_fields, list)
                                         and all(isinstance(f, str) for f in reset_fields)):
        raise _settings_error("reset_fields", f"must be a list of field names or null, got {reset_fields!r}")
    settings = ServerSettings.make(url, command, timeout_s, start_timeout_s, max_message_mb)
    return OpenEnvEpisode(metadata, server_for(settings), mode, tool_name, answer_field, answer_tool,
                          reset_fields, observation_field)
