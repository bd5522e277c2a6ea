"""The client side of an OpenEnv server for :mod:`megarlhf.envs.openenv`: where the server is (a URL, or a
process this module starts, restarts when it has died, and stops at exit), its tools, and its WebSocket
sessions.

One :class:`OpenEnvServer` per settings per process (:func:`server_for`), shared by every episode of that
process. A server is checked when it is first needed (``GET /health``): one that cannot be reached, or whose
command exits or does not answer within ``start_timeout_s``, stops the run with a :class:`ConfigError` naming
it. After that a failure belongs to the call that met it (the runner shows it to the model and counts it).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

from megarlhf.core.errors import ConfigError
from megarlhf.envs.api import ToolSpec

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
SHOWN_CHARS = 300  # characters of a reply or a log quoted in an error


class OpenEnvProtocolError(RuntimeError):
    """The server's reply is not OpenEnv's protocol, or the server failed the message itself."""


class OpenEnvStepError(OpenEnvProtocolError):
    """The environment raised in ``step`` (the server says EXECUTION_ERROR): that call fails, the session
    goes on."""


# resolved before any fork: the server's pre-exec hook must not load libraries in the child
_prctl = ctypes.CDLL(None, use_errno=True).prctl
# the servers are local or named by URL: a proxy from the environment (http_proxy) must not come between
_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_STOP_GRACE_S = 5.0  # a stopped server's process group gets SIGTERM, then SIGKILL after this


@dataclass(frozen=True)
class ServerSettings:
    url: str | None
    command: tuple[str, ...] | None
    timeout_s: float
    start_timeout_s: float
    max_message_mb: int

    @staticmethod
    def make(url: Any, command: Any, timeout_s: Any, start_timeout_s: Any, max_message_mb: Any) -> "ServerSettings":
        if (url is None) == (command is None):
            raise ValueError("the openenv environment needs exactly one of rollout.env.kwargs.url (a running "
                             "server) and rollout.env.kwargs.command (a server to start)")
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"rollout.env.kwargs.url must be an http:// or https:// URL, got {url!r}")
        if command is not None and not (isinstance(command, list) and command
                                        and all(isinstance(part, str) for part in command)
                                        and any("{port}" in part for part in command)):
            raise ValueError(f"rollout.env.kwargs.command must be a list of strings with a '{{port}}' placeholder "
                             f"for the port the server is to listen on, got {command!r}")
        for key, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
                raise ValueError(f"rollout.env.kwargs.{key} must be a positive number, got {value!r}")
        if isinstance(max_message_mb, bool) or not isinstance(max_message_mb, int) or not 1 <= max_message_mb <= 1024:
            raise ValueError(f"rollout.env.kwargs.max_message_mb must be an int in [1, 1024], got {max_message_mb!r}")
        return ServerSettings(url.rstrip("/") if url else None, tuple(command) if command else None,
                              float(timeout_s), float(start_timeout_s), int(max_message_mb))


_servers: dict[ServerSettings, "OpenEnvServer"] = {}
_servers_lock = threading.Lock()


def server_for(settings: ServerSettings) -> "OpenEnvServer":
    """This process's server of ``settings`` (started and checked at the first request for it)."""
    with _servers_lock:
        if settings not in _servers:
            server = OpenEnvServer(settings)
            server.start_or_check()
            _servers[settings] = server
        server = _servers[settings]
    server.restart_if_exited()
    return server


@atexit.register
def stop_servers() -> None:
    """Stops the servers this process started (also done by the kernel if the process dies: PDEATHSIG)."""
    with _servers_lock:
        for server in _servers.values():
            server.stop()
        _servers.clear()


class OpenEnvServer:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.url = settings.url
        self.process: subprocess.Popen | None = None
        self.log_path: str | None = None
        self.restarts = 0
        self._tools: dict[tuple[str, str], list[ToolSpec]] = {}
        self._lock = threading.Lock()

    # ---- the process --------------------------------------------------------------------------------
    def start_or_check(self) -> None:
        """Starts the server's command, or checks that the server at the URL answers."""
        if self.settings.command is not None:
            self._start()
        elif not self._healthy(timeout=self.settings.timeout_s):
            raise ConfigError(f"rollout.env.kwargs.url: no OpenEnv server answers at {self.url}/health")

    def restart_if_exited(self) -> None:
        """Starts the command again if its server has exited. Called where episodes are made (the rollout's
        thread, which lives as long as the process: the server's PDEATHSIG follows the thread that started it),
        so a server that dies fails the calls of the batch that met it and the next batch has one again."""
        if self.process is None or self.process.poll() is None:
            return
        with self._lock:
            if self.process.poll() is None:
                return
            self.restarts += 1
            logger.warning("the OpenEnv server %s exited with code %s; restarting it. Its output ended: %s",
                           self._name(), self.process.returncode, self._log_tail())
            self._start()

    def _start(self) -> None:
        port = _free_port()
        command = [part.replace("{port}", str(port)) for part in self.settings.command]
        if self.log_path is not None and os.path.exists(self.log_path):
            os.unlink(self.log_path)
        fd, self.log_path = tempfile.mkstemp(prefix="megarlhf-openenv-", suffix=".log")
        try:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                                            start_new_session=True,
                                            preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        except OSError as exc:
            raise ConfigError(f"rollout.env.kwargs.command {command!r} could not start: {exc}") from None
        finally:
            os.close(fd)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ConfigError(f"rollout.env.kwargs.command {command!r} exited with code "
                                  f"{self.process.returncode} before serving; its output ends: {self._log_tail()}")
            if self._healthy(timeout=1.0):
                return
            time.sleep(0.2)
        tail = self._log_tail()
        self.stop()
        raise ConfigError(f"rollout.env.kwargs.command {command!r} did not answer at {self.url}/health within "
                          f"start_timeout_s={self.settings.start_timeout_s}; its output ends: {tail}")

    def stop(self) -> None:
        """SIGTERM to the server's process group (a wrapper such as ``docker run`` stops its container on
        it), SIGKILL after a grace period."""
        if self.process is not None and self.process.returncode is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=_STOP_GRACE_S)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            try:  # whatever of its group is left (children of a leader that exited within the grace period)
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        if self.log_path is not None and os.path.exists(self.log_path):
            os.unlink(self.log_path)

    def _healthy(self, timeout: float) -> bool:
        try:
            with _no_proxy.open(f"{self.url}/health", timeout=timeout) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, os.path.getsize(self.log_path) - SHOWN_CHARS))
                return repr(log.read().decode(errors="replace"))
        except OSError:
            return "(no output)"

    def _name(self) -> str:
        return self.url if self.settings.command is None else repr(list(self.settings.command))

    # ---- what it offers -----------------------------------------------------------------------------
    def tools(self, mode: str, tool_name: str) -> list[ToolSpec]:
        """The tools of the server's episodes: its action as one tool, or its MCP tools (asked once)."""
        key = (mode, tool_name)
        with self._lock:
            if key not in self._tools:
                self._tools[key] = self._mcp_tools() if mode == "mcp" else [self._action_tool(tool_name)]
            return list(self._tools[key])

    def _action_tool(self, tool_name: str) -> ToolSpec:
        schema = self._get_json("/schema").get("action")
        if not (isinstance(schema, dict) and schema.get("type") == "object"):
            raise ConfigError(f"the OpenEnv server {self._name()} has no action schema of type object: {schema!r}")
        parameters = {k: v for k, v in schema.items() if k not in ("title", "description")}
        parameters["properties"] = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
        description = schema.get("description") or self._get_json("/metadata").get("description") or tool_name
        return ToolSpec(tool_name, str(description), parameters)

    def _mcp_tools(self) -> list[ToolSpec]:
        try:
            session = self.session()
            try:
                reply = session.request("step", {"type": "list_tools"})
            finally:
                session.close()
        except OpenEnvProtocolError as exc:
            raise ConfigError(f"the OpenEnv server {self._name()} could not list its MCP tools: {exc}") from None
        observation = reply.get("data", {}).get("observation") if reply["kind"] == "observation" else None
        tools = observation.get("tools") if isinstance(observation, dict) else None
        if not isinstance(tools, list) or not tools:
            raise ConfigError(f"the OpenEnv server {self._name()} listed no MCP tools (mode: mcp needs an "
                              f"MCPEnvironment): {str(reply)[:SHOWN_CHARS]}")
        try:
            return [ToolSpec(t["name"], t.get("description") or "", t.get("input_schema") or {"type": "object"})
                    for t in tools]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"the OpenEnv server {self._name()} listed a tool megarlhf cannot offer: {exc}") from None

    def check_answer(self, mode: str, tool_name: str, answer_field: str | None, answer_tool: str | None) -> None:
        """The final answer's setting fits the server: ``answer_field`` is a string field of the action, or an
        argument of ``answer_tool``, one of its MCP tools (otherwise every answer would be refused and nothing
        would reward it)."""
        if answer_field is None:
            return
        tools = {spec.name: spec for spec in self.tools(mode, tool_name)}
        name = answer_tool if mode == "mcp" else tool_name
        if name not in tools:
            raise ConfigError(f"rollout.env.kwargs.answer_tool {answer_tool!r} is not one of the OpenEnv server's MCP "
                              f"tools {sorted(tools)}")
        spec = tools[name]
        field_type = spec.parameters.get("properties", {}).get(answer_field, {}).get("type", "string")
        if answer_field not in spec.properties or set(spec.required) - {answer_field} or field_type != "string":
            raise ConfigError(f"rollout.env.kwargs.answer_field {answer_field!r} must be the one required (string) "
                              f"field of {'the tool ' + repr(name) if mode == 'mcp' else 'the action'} "
                              f"(its fields: {spec.properties}, required: {spec.required})")

    def _get_json(self, path: str) -> dict[str, Any]:
        try:
            with _no_proxy.open(f"{self.url}{path}", timeout=self.settings.timeout_s) as reply:
                data = json.loads(reply.read(self.settings.max_message_mb << 20))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"the OpenEnv server {self._name()} did not answer GET {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"the OpenEnv server {self._name()} answered GET {path} with {str(data)[:SHOWN_CHARS]}")
        return data

    def session(self) -> "Session":
        """A new WebSocket session (one environment instance on the server)."""
        return Session(self.url.replace("http", "ws", 1) + "/ws", self.settings)


class Session:
    """One WebSocket connection to ``/ws``: requests answered in order, each within ``timeout_s``."""

    def __init__(self, url: str, settings: ServerSettings):
        self.timeout_s = settings.timeout_s
        self.broken: str | None = None
        try:
            self.socket = connect(url, open_timeout=settings.timeout_s, max_size=settings.max_message_mb << 20,
                                  proxy=None, compression=None, close_timeout=min(settings.timeout_s, 1.0))
        except (OSError, WebSocketException, TimeoutError) as exc:
            raise OpenEnvProtocolError(f"could not open a session at {url}: {exc}") from None

    def request(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """``{"kind": "observation", "data": ...}`` or ``{"kind": "refused", "message": ...}`` (the server
        rejected the action as invalid: the model's fault, shown to it); anything else raises, and breaks the
        session for good: a late reply would otherwise be read as the next request's, and a new session
        would be a new environment in the middle of the episode."""
        if self.broken is not None:
            raise OpenEnvProtocolError(f"the episode's session was lost earlier ({self.broken})")
        try:
            return self._request(kind, data)
        except OpenEnvStepError:
            raise
        except Exception as exc:
            self.broken = str(exc)[:SHOWN_CHARS]
            self.socket.close()
            raise

    def _request(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        try:
            self.socket.send(json.dumps({"type": kind, "data": data}, default=str))
            raw = self.socket.recv(timeout=self.timeout_s)
        except TimeoutError:
            raise OpenEnvProtocolError(f"the server did not answer a {kind!r} within {self.timeout_s} s") from None
        except (OSError, WebSocketException) as exc:
            raise OpenEnvProtocolError(f"the session broke during a {kind!r}: {exc}") from None
        try:
            reply = json.loads(raw)
        except (TypeError, ValueError):
            raise OpenEnvProtocolError(f"the server answered a {kind!r} with non-JSON "
                                       f"{str(raw)[:SHOWN_CHARS]!r}") from None
        kind_of_reply = reply.get("type") if isinstance(reply, dict) else None
        body = reply.get("data") if isinstance(reply, dict) else None
        if kind_of_reply == "observation" and isinstance(body, dict):
            return {"kind": "observation", "data": body}
        if kind_of_reply == "error" and isinstance(body, dict):
            message = f"{body.get('message')}{_validation_details(body.get('errors'))}"
            if body.get("code") == "VALIDATION_ERROR" and kind == "step":
                return {"kind": "refused", "message": message[:2 * SHOWN_CHARS]}
            if body.get("code") == "EXECUTION_ERROR" and kind == "step":
                raise OpenEnvStepError(f"the environment failed the step: {message[:2 * SHOWN_CHARS]}")
            if body.get("code") == "CAPACITY_REACHED":
                message += " (the server's max_concurrent_envs must allow one session per running episode)"
            raise OpenEnvProtocolError(f"the server refused a {kind!r}: {message[:2 * SHOWN_CHARS]}")
        raise OpenEnvProtocolError(f"the server answered a {kind!r} with {str(raw)[:SHOWN_CHARS]!r}, "
                                   f"not an observation")

    def close(self) -> None:
        try:
            self.socket.send(json.dumps({"type": "close", "data": {}}))
        except (OSError, WebSocketException):
            pass
        self.socket.close()


def _validation_details(errors: Any) -> str:
    if not isinstance(errors, list):
        return ""
    parts = [f"{'.'.join(map(str, e.get('loc', [])))}: {e.get('msg')}" for e in errors[:5] if isinstance(e, dict)]
    return f" ({'; '.join(parts)})" if parts else ""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent(parent: int) -> None:
    """In the server's process before exec: the kernel kills it when the thread that started it dies (servers
    are started on the rollout's thread, which lives as long as the process)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the hook ran
        os._exit(1)
