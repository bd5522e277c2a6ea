"""SFT conversations that use a tool, written exactly as a multi-turn chat rollout will render them.

A tool-using model is usually warmed up by SFT on transcripts before RL (the SmolLM2 tool recipes,
``smollm2_sft_tools.yaml``). The transcripts must match what the rollout shows the model token for token,
or the SFT teaches a format the RL run never presents. So each conversation is built from the run's own
pieces rather than hand-written text:

- the system message carries the tools' description from :func:`megarlhf.envs.prompting.tool_describer`
  (the parser's instructions, appended with :func:`megarlhf.data.prompts.with_tool_text`, as
  :func:`megarlhf.data.prompts.render_prompt` does for a template without tool support);
- the assistant's call is the parser's own :meth:`format_call` of ``{"expression": <row's expression>}``;
- the tool message is what the environment's episode returns for that call (run here, not assumed);
- the last assistant message is the final-answer line.

A share ``tool_fraction`` of the rows (a seeded draw per row) become such transcripts; the others keep
their worked solution as the single assistant message, under the same system message, so that the SFT
model sees the tools offered and sometimes not used. Rows are written as ``{"messages": [...]}`` for
``data.messages_key: messages``. Templates that render ``tools=`` themselves (Qwen2.5's) are refused:
SFT rows do not pass ``tools=`` to the template yet, and a description as text would differ from the
rollout's prompt.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from megarlhf.data.prompts import episode_fields, row_messages, template_renders_tools, with_tool_text
from megarlhf.config.data import DataConfig
from megarlhf.data.source import read_records
from megarlhf.data.synthetic import final_answer, write_jsonl
from megarlhf.config.rollout import EnvConfig
from megarlhf.envs.api import resolve_environment
from megarlhf.envs.parsers import PARSERS
from megarlhf.envs.prompting import tool_describer
from megarlhf.envs.tool_calls import ParsedCall
from megarlhf.core.errors import DataError


def tool_conversation(metadata: dict, answer: str, config: EnvConfig, tokenizer: Any, where: str,
                      argument: str = "expression") -> list[dict[str, str]]:
    """A problem solved with one call of the environment's only tool on ``metadata[argument]``; the
    episode is made from ``metadata`` as a rollout makes it (``PromptExample.episode_fields``)."""
    try:
        episode = resolve_environment(config.name)(dict(metadata), **config.kwargs)
        tools = list(episode.tools)
        if len(tools) != 1:
            raise DataError(f"environment {config.name!r} offers {len(tools)} tools; a transcript calls the one "
                            f"tool of a single-tool environment")
        call = ParsedCall(tools[0].name, {argument: metadata[argument]})
        calling = PARSERS.get(config.parser)(tools, tokenizer).format_call(call)
        result = episode.step([{"role": "assistant", "content": calling}], call)
    except Exception as exc:  # the environment may be user code: say which row it failed on
        raise DataError(f"{where}: {type(exc).__name__}: {exc}") from exc
    observation = result.observation
    if not isinstance(observation, str) or result.info.get("tool_error"):
        raise DataError(f"{where}: the tool refused the row's {argument} {metadata[argument]!r}: {observation!r}")
    if len(observation) > config.max_observation_chars:  # a rollout would cut it: the transcript would differ
        raise DataError(f"{where}: the tool's answer has {len(observation)} characters, more than "
                        f"rollout.env.max_observation_chars={config.max_observation_chars}")
    if observation.strip() != answer.strip():
        raise DataError(f"{where}: the tool returned {observation!r} for {metadata[argument]!r}, but the "
                        f"row's answer is {answer!r}")
    return [{"role": "assistant", "content": calling}, {"role": "tool", "content": observation},
            {"role": "assistant", "content": final_answer(answer, "answer_is")}]


def _require(row: dict, fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if f not in row]
    if missing:
        raise DataError(f"{where} has no field {', '.join(map(repr, missing))}; its fields: {sorted(row)}")


def transcript_rows(problems: list[dict], solutions: list[dict], config: EnvConfig, tokenizer: Any,
                    tool_fraction: float, seed: int, system_prompt: str | None = None) -> list[dict]:
    """SFT rows (``messages``) for ``problems`` (prompt, answer, expression) whose worked solutions are
    ``solutions`` (prompt, response), row for row; see the module docstring. ``system_prompt`` is the RL
    run's ``data.system_prompt``, if it sets one."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise DataError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    if len(problems) != len(solutions):
        raise DataError(f"{len(problems)} problems but {len(solutions)} solutions: they must match row for row")
    if template_renders_tools(tokenizer):
        raise DataError("the tokenizer's chat template renders tools= itself; SFT rows do not pass tools= to "
                        "the template, so a transcript would not match the rollout's prompt")
    describe = tool_describer(replace(config, describe_tools=True), tokenizer)
    prompt_config = DataConfig(system_prompt=system_prompt)
    rng = random.Random(f"{seed}-tool-transcripts")
    rows = []
    for i, (problem, solution) in enumerate(zip(problems, solutions)):
        where = f"row {i}"
        _require(problem, ("prompt", "answer", "expression"), f"{where} of the problems")
        _require(solution, ("prompt", "response"), f"{where} of the solutions")
        if problem["prompt"] != solution["prompt"]:
            raise DataError(f"{where}: the problem's prompt {problem['prompt']!r} differs from the "
                            f"solution's {solution['prompt']!r}")
        # what a rollout's environment gets: the row's other fields and its answer as ground_truth
        fields = {k: v for k, v in problem.items() if k not in ("prompt", "answer")}
        metadata = episode_fields(problem["answer"], fields)
        try:
            description = describe(metadata).text
        except Exception as exc:  # user code, as in build_prompt_dataset
            raise DataError(f"{where}: the environment could not describe its tools: "
                            f"{type(exc).__name__}: {exc}") from exc
        # the RL prompt's messages (data.system_prompt first, if set), then the tools' description, as render_prompt
        start = with_tool_text(row_messages(problem, prompt_config, where), description)
        if rng.random() < tool_fraction:
            turns = tool_conversation(metadata, str(problem["answer"]), config, tokenizer, where)
        else:
            turns = [{"role": "assistant", "content": solution["response"]}]
        rows.append({"messages": start + turns})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write SFT conversations that call a tool (see the module "
                                                 "docstring).")
    parser.add_argument("problems", help="JSONL rows with prompt, answer and the tool's argument (expression)")
    parser.add_argument("solutions", help="JSONL rows with prompt and response (worked solutions), row for row")
    parser.add_argument("--out", required=True, help="the JSONL file to write ({'messages': [...]} rows)")
    parser.add_argument("--tokenizer", required=True, help="the model directory whose tokenizer and template "
                                                           "the RL run uses")
    parser.add_argument("--env", default="calculator")
    parser.add_argument("--parser", default="hermes")
    parser.add_argument("--tool-fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-prompt", default=None, help="the RL run's data.system_prompt, if it sets one")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rows = transcript_rows(read_records(args.problems), read_records(args.solutions),
                           EnvConfig(name=args.env, parser=args.parser), tokenizer, args.tool_fraction, args.seed,
                           args.system_prompt)
    path = write_jsonl(rows, Path(args.out), ("messages",))
    calls = sum(len(r["messages"]) > 3 for r in rows)
    print(json.dumps({"out": str(path), "rows": len(rows), "tool_transcripts": calls}))


if __name__ == "__main__":
    main()
