"""Environments and tools for multi-turn, tool-calling rollouts: the environment contract and registry
(api.py; the tool-call types in tool_calls.py), tool-call parsers (parsers.py), the tools' description in
prompts (prompting.py), the built-in ``calculator``, ``lookup``, ``code`` and ``repo`` tools, the ``openenv``
client of OpenEnv servers (openenv.py, openenv_server.py), and the time-bounded runner of one turn's tool
calls (runner.py). The rollout loop itself lives in the trainer.
"""
from megarlhf.envs import calculator as _calculator  # noqa: F401  (registers the built-in environments)
from megarlhf.envs import code as _code  # noqa: F401
from megarlhf.envs import lookup as _lookup  # noqa: F401
from megarlhf.envs import openenv as _openenv  # noqa: F401
from megarlhf.envs import repo as _repo  # noqa: F401
from megarlhf.envs.api import (ENVIRONMENTS, Episode, ParsedCall, ParseError, StepResult, ToolEpisode, ToolError,
                               ToolSpec, load_object, resolve_environment)
from megarlhf.envs.calculator import CalculatorLimits, calculate, evaluate
from megarlhf.envs.lookup import LookupTable
from megarlhf.envs.parsers import PARSERS, CallFormat, ToolCallParser, detect_format
from megarlhf.envs.runner import EpisodeHandle, StepBatch, ToolFailure, ToolRunner, TurnOutcome

__all__ = [
    "ENVIRONMENTS", "Episode", "ParsedCall", "ParseError", "StepResult", "ToolEpisode", "ToolError",
    "ToolSpec", "load_object", "resolve_environment", "CalculatorLimits", "calculate", "evaluate", "LookupTable",
    "PARSERS", "CallFormat", "ToolCallParser", "detect_format", "EpisodeHandle", "StepBatch", "ToolFailure",
    "ToolRunner", "TurnOutcome",
]
