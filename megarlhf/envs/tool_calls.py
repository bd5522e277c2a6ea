"""The vocabulary of tool calls, shared by the environment contract (:mod:`megarlhf.envs.api`) and the
tool-call parsers (:mod:`megarlhf.envs.parsers`): a tool's description, a well-formed call, a malformed one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: its name, what it does, and a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self):
        if not (isinstance(self.name, str) and self.name.strip() == self.name and self.name):
            raise ValueError(f"ToolSpec.name must be a non-empty string without surrounding spaces, "
                             f"got {self.name!r}")
        if not (isinstance(self.parameters, dict) and self.parameters.get("type") == "object"):
            raise ValueError(f"ToolSpec {self.name!r}: parameters must be a JSON schema of type 'object', "
                             f"got {self.parameters!r}")

    @property
    def required(self) -> list[str]:
        return list(self.parameters.get("required", []))

    @property
    def properties(self) -> list[str]:
        return list(self.parameters.get("properties", {}))

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema that chat templates take as ``tools=[...]``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ParsedCall:
    """One well-formed tool call: a known tool name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseError:
    """A malformed tool call. ``message`` is written for the model: the runner shows it as the
    observation ``"error: <message>"`` so that the model can correct the call."""

    message: str
