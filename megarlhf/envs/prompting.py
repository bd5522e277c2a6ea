"""How a multi-turn run describes its environment's tools in the prompt (``rollout.env.describe_tools``).

:func:`tool_describer` gives :func:`megarlhf.data.prompts.build_prompt_dataset` a function from a row's
metadata to its :class:`~megarlhf.data.prompts.ToolDescription`: the tools of an episode made for that row
(the factory runs once per row at load, so a factory should leave costly set-up to its first ``step``),
as JSON schemas for templates that render ``tools=`` and as the parser's instructions (the schemas and
the call format) for prompts whose template does not. The rollout checks that the episodes it starts
offer the tools their prompts describe.
"""
from __future__ import annotations

from typing import Any

from megarlhf.data.prompts import ToolDescriber, ToolDescription
from megarlhf.config.rollout import EnvConfig
from megarlhf.envs.api import ToolSpec, resolve_environment
from megarlhf.envs.parsers import PARSERS


def tool_schemas(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    return [spec.schema() for spec in tools]


def tool_describer(config: EnvConfig, tokenizer: Any) -> ToolDescriber | None:
    """The describer of ``config``'s environment, None when ``describe_tools`` is off."""
    if not config.describe_tools:
        return None
    factory, make_parser = resolve_environment(config.name), PARSERS.get(config.parser)

    def describe(metadata: dict[str, Any]) -> ToolDescription:
        tools = list(factory(metadata, **config.kwargs).tools)
        return ToolDescription(tool_schemas(tools), make_parser(tools, tokenizer).instructions())

    return describe
