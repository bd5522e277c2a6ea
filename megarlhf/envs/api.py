"""The environment contract of multi-turn, tool-calling rollouts: one factory signature, its registry, the
types a step exchanges, and the ``rollout.env`` settings.

An environment is a **per-episode object made by a factory** (one episode = one rollout sample)::

    factory(metadata: dict, **kwargs) -> Episode          # registered in ENVIRONMENTS, or a dotted path
    episode.tools: Sequence[ToolSpec]                     # what the model may call in this episode
    episode.step(messages, call: ParsedCall) -> StepResult

``metadata`` is the dataset row's other fields (the same dict a reward sees as ``RewardInput.metadata``) and,
in a rollout, the row's answer as ``ground_truth`` (None without one; a row's own field of that name wins);
``kwargs`` are :attr:`EnvConfig.kwargs`. ``messages`` is the conversation so far (``{"role", "content"}``
dicts, the last one the model's turn holding the call) and ``call`` the parsed tool call. A class whose
``__init__(self, metadata, **kwargs)`` sets ``tools`` and defines ``step`` is a factory as it stands.

Why an episode object rather than a stateless callable: a game or a search session keeps state between
turns (the board, the pages already opened), and a factory per sample is the one place such state can
live without the caller threading it through. Stateless tools pay nothing for it: :class:`ToolEpisode`
wraps plain functions ``tool(**arguments) -> str`` and a factory may hand every sample the same one.
Two optional methods: ``episode.final_answer(messages) -> StepResult | None`` takes the model's final turn (one
without a tool call) and may reward it (an environment that scores answers itself); ``episode.close()`` is
called once, when the episode ends or at the latest when the batch's rollout does (an episode holding a
connection or a process releases it).
A tool signals a refusal the model should read (bad arguments, "division by zero") by raising
:class:`ToolError`; :class:`ToolEpisode` turns it into the observation ``"error: <message>"``. Any other
exception is a failure that :mod:`megarlhf.envs.runner` reports.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from megarlhf.envs.tool_calls import ParsedCall, ParseError, ToolSpec  # the contract's step types, re-exported here
from megarlhf.core.errors import ConfigError
from megarlhf.core.registry import Registry, is_dotted_path, load_object

Message = dict[str, str]  # {"role": "system" | "user" | "assistant" | "tool", "content": str}


@dataclass
class StepResult:
    """What one step returns. ``observation`` is the text the model reads next (``None`` only together
    with ``done=True``); ``reward`` is this step's reward, ``None`` for none; ``info`` is free-form except
    for two keys the runner reads or writes: ``tool_error`` (set by :class:`ToolEpisode` on a refusal) and
    ``truncated_from`` (the observation's length before it was cut)."""

    observation: str | None
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


class ToolError(Exception):
    """Raised by a tool to refuse a call with a message for the model (a normal observation, not a failure)."""


class Episode(Protocol):
    """One sample's environment (see the module docstring)."""

    tools: Sequence[ToolSpec]

    def step(self, messages: list[Message], call: ParsedCall) -> StepResult: ...


EnvFactory = Callable[..., Episode]  # factory(metadata: dict, **kwargs) -> Episode
ENVIRONMENTS: Registry[EnvFactory] = Registry("environment")


def stateless(factory: EnvFactory) -> EnvFactory:
    """Declares that an environment's episodes keep no state between steps: ``step``'s result depends on
    the row's metadata, the factory's kwargs, the conversation and the call only. Its calls then run in
    worker processes the runner can kill, each on an episode made afresh for the call
    (:mod:`megarlhf.envs.runner`); every other environment keeps its episodes in the trainer's process."""
    factory.megarlhf_stateless = True
    return factory


def is_stateless(factory: EnvFactory) -> bool:
    return getattr(factory, "megarlhf_stateless", False) is True


class ToolEpisode:
    """An episode of stateless tools: ``functions[name](**arguments)`` returns the observation string.

    Thread-safe as long as the functions are, so a factory may return one shared instance."""

    def __init__(self, tools: Sequence[ToolSpec], functions: Mapping[str, Callable[..., Any]]):
        names = [spec.name for spec in tools]
        if sorted(names) != sorted(functions) or len(set(names)) != len(names):
            raise ValueError(f"ToolEpisode: tools {names} and functions {sorted(functions)} must name the "
                             f"same tools, each once")
        self.tools = list(tools)
        self.functions = dict(functions)

    def step(self, messages: list[Message], call: ParsedCall) -> StepResult:
        try:
            observation = self.functions[call.name](**call.arguments)
        except ToolError as exc:
            return StepResult(f"error: {exc}", info={"tool_error": str(exc)})
        # a non-string return is passed on as it is: the runner reports it as a failure of this tool
        return StepResult(observation)


def _unknown_environment(name: str) -> ValueError:
    return ValueError(f"unknown environment {name!r}; known: {', '.join(ENVIRONMENTS.names())}, "
                      f"or a dotted path 'pkg.module:factory'")


def resolve_environment(name: str) -> EnvFactory:
    """A registered environment factory by name, else a user class/function by dotted path."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS.get(name)
    if not is_dotted_path(name):
        raise _unknown_environment(name)
    factory = load_object(name, "environment")
    if not callable(factory):
        raise ConfigError(f"environment {name!r} is a {type(factory).__name__}, not a class or function")
    return factory


