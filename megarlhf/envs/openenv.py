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
``{answer_field: text}``; both checked against the server's schema or tools at start-up) and the step's reward
counts; the episode ends there whatever the step says. An ``MCPEnvironment`` rewards a tool call only where
the environment sets the observation's reward (OpenEnv's default leaves it None).

Each episode holds one server session (one environment instance) from its first call until it is done or the
rollout ends, so the server's ``max_concurrent_envs`` must allow a session per episode a rank runs at once
(``rollout.n_samples`` x the rank's prompts); OpenEnv's default is 1.

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
import threading
from dataclasses import dataclass, fields
from typing import Any

from megarlhf.envs.api import ENVIRONMENTS, Message, ParsedCall, StepResult, ToolSpec
from megarlhf.envs.openenv_server import SHOWN_CHARS, OpenEnvProtocolError, ServerSettings, server_for
from megarlhf.isolation.timed_calls import shown

_MODES = ("action", "mcp")


def _settings_error(key: str, why: str) -> ValueError:
    return ValueError(f"rollout.env.kwargs.{key} of the openenv environment {why}")


class OpenEnvEpisode:
    """One sample's session with an OpenEnv server (see the module docstring)."""

    def __init__(self, metadata: dict[str, Any], server: Any, settings: "OpenEnvSettings"):
        self.server, self.mode, self.tool_name = server, settings.mode, settings.tool_name
        self.answer_field, self.answer_tool = settings.answer_field, settings.answer_tool
        self.observation_field, reset_fields = settings.observation_field, settings.reset_fields
        missing = [k for k in reset_fields or () if k not in metadata]
        if missing:
            raise ValueError(f"rollout.env.kwargs.reset_fields names {missing}, which the row does not have "
                             f"(its fields: {sorted(metadata)})")
        self.reset_data = dict(metadata if reset_fields is None else {k: metadata[k] for k in reset_fields})
        self.tools = server.tools(self.mode, self.tool_name)
        server.check_answer(self.mode, self.tool_name, self.answer_field, self.answer_tool)
        # opened at the first step (describing the tools of a row needs no session), closed when the episode is
        # done or the rollout ends; the lock orders a late step of a timed-out call against close()
        self.session = None
        self.closed = False
        self.lock = threading.Lock()

    def step(self, messages: list[Message], call: ParsedCall) -> StepResult:
        if self.mode == "mcp":
            return self._act({"type": "call_tool", "tool_name": call.name, "arguments": call.arguments})
        if call.name != self.tool_name:
            return _refused(f"unknown tool {call.name!r}; the tool is {self.tool_name!r}")
        return self._act(dict(call.arguments))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            session, self.session = self.session, None
        if session is not None:
            session.close()

    def _act(self, action: dict[str, Any], final: bool = False) -> StepResult:
        with self.lock:
            if self.closed:
                raise OpenEnvProtocolError("the episode was closed (its rollout ended) before this call ran")
            if self.session is None:
                session = self.server.session()
                try:
                    session.request("reset", self.reset_data)
                except Exception:
                    session.close()
                    raise
                self.session = session
            session = self.session
        reply = session.request("step", action)
        result = _refused(reply["message"]) if reply["kind"] == "refused" else self._result(reply["data"])
        if result.done or final:  # the server's environment is no longer needed: its slot is freed now
            self.close()
        return result

    def _result(self, data: dict[str, Any]) -> StepResult:
        observation, reward, done = data.get("observation"), data.get("reward"), data.get("done", False)
        if not isinstance(observation, dict) or not isinstance(done, bool):
            raise OpenEnvProtocolError(f"the server's observation is not an OpenEnv step result: "
                                       f"{shown(data, SHOWN_CHARS)}")
        if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            raise OpenEnvProtocolError(f"the server's reward is not a finite number: {shown(reward, SHOWN_CHARS)}")
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
                                           f"(rollout.env.kwargs.observation_field): {shown(observation, SHOWN_CHARS)}")
            value = fields[self.observation_field]
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
            return next(iter(fields.values()))
        return json.dumps(fields, ensure_ascii=False)


class OpenEnvAnsweringEpisode(OpenEnvEpisode):
    """An episode whose final answer (a turn without a tool call) goes to the environment (``answer_field``)."""

    def final_answer(self, messages: list[Message]) -> StepResult:
        """The answer as a step; its reward counts. An action-mode answer the server rejects fails (the setting
        does not fit the environment's action, so nothing would reward it); an MCP answer tool's error is the
        answer's outcome, unrewarded."""
        text = messages[-1]["content"]
        if self.mode == "mcp":
            action = {"type": "call_tool", "tool_name": self.answer_tool, "arguments": {self.answer_field: text}}
        else:
            action = {self.answer_field: text}
        result = self._act(action, final=True)
        if "tool_error" in result.info and self.mode == "action":
            raise OpenEnvProtocolError(f"the server rejected the final answer as {action!r}: "
                                       f"{result.info['tool_error']}")
        return StepResult(None, True, result.reward, result.info)


def _refused(message: str) -> StepResult:
    return StepResult(f"error: {message}", info={"tool_error": message})


def _tool_text(observation: dict[str, Any]) -> tuple[str, str | None]:
    """An MCP call's (result text, error message or None)."""
    error = observation.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else None
        return "", message if isinstance(message, str) else shown(error, SHOWN_CHARS)
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


@dataclass(frozen=True)
class OpenEnvSettings:
    """``rollout.env.kwargs`` of the ``openenv`` environment (see the module docstring)."""

    url: str | None = None  # a running server
    command: list[str] | None = None  # or a server to start, with a "{port}" placeholder
    mode: str = "action"  # or "mcp"
    tool_name: str = "step"  # action mode: the name of the one tool
    answer_field: str | None = None  # the final answer goes to this action field / answer_tool argument
    answer_tool: str | None = None  # mcp mode: the tool the final answer goes to
    reset_fields: list[str] | None = None  # the row's fields reset receives (None: all)
    observation_field: str | None = None  # the observation's field shown to the model
    timeout_s: float = 30.0  # per message to the server
    start_timeout_s: float = 120.0  # for a started server to answer /health
    max_message_mb: int = 16  # the largest reply taken

    def __post_init__(self):
        if self.mode not in _MODES:
            raise _settings_error("mode", f"must be one of {list(_MODES)}, got {self.mode!r}")
        for key in ("tool_name", "answer_field", "answer_tool", "observation_field"):
            value = getattr(self, key)
            if not (value is None and key != "tool_name" or isinstance(value, str) and value):
                raise _settings_error(key, f"must be a non-empty string{'' if key == 'tool_name' else ' or null'}, "
                                           f"got {value!r}")
        if (self.mode == "mcp" and self.answer_field is not None) != (self.answer_tool is not None):
            raise _settings_error("answer_tool", "names the MCP tool the final answer goes to: it is needed with "
                                  "answer_field in mcp mode and only there")
        if self.reset_fields is not None and not (isinstance(self.reset_fields, list)
                                                  and all(isinstance(f, str) for f in self.reset_fields)):
            raise _settings_error("reset_fields", f"must be a list of field names or null, got {self.reset_fields!r}")


@ENVIRONMENTS.register("openenv")
def openenv_env(metadata: dict, **kwargs: Any) -> OpenEnvEpisode:
    """An episode of the OpenEnv server at ``url``, or of the one ``command`` starts (see the module docstring)."""
    known = [f.name for f in fields(OpenEnvSettings)]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"rollout.env.kwargs of the openenv environment: unknown key(s) {unknown}; known: {known}")
    settings = OpenEnvSettings(**kwargs)
    server = server_for(ServerSettings.make(settings.url, settings.command, settings.timeout_s,
                                            settings.start_timeout_s, settings.max_message_mb))
    episode = OpenEnvEpisode if settings.answer_field is None else OpenEnvAnsweringEpisode
    return episode(metadata, server, settings)
