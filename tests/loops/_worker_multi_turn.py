"""Rank script of the multi-turn driver test: the real driver with a scripted environment in which every
model turn "calls" the tool (so a random tiny model produces multi-turn samples) and the tool answers
with fixed text. Usage: _worker_multi_turn.py RECIPE [overrides]."""
import os
import sys

from megarlhf.config import RunConfig, load_config
from megarlhf.envs.api import ENVIRONMENTS, ParsedCall, StepResult, ToolSpec
from megarlhf.envs.parsers import PARSERS
from megarlhf.loops.rl import train_rl


class EveryTurnParser:
    stop_token_ids = ()
    special_marker_ids = ()

    def __init__(self, tools, tokenizer=None):
        pass

    def __call__(self, text):
        return ParsedCall("script", {})


class ScriptedEpisode:
    """Answers with fixed text, or (``random=True``) with text that differs call by call and process by
    process, as a tool that reads a clock or the network would."""

    tools = [ToolSpec("script", "answers with fixed text")]

    def __init__(self, metadata, random: bool = False):
        self.calls, self.random = 0, random

    def step(self, messages, call):
        self.calls += 1
        noise = f" ({os.urandom(4).hex()})" if self.random else ""
        return StepResult(f"observation {self.calls}: 2 + 2 = 4{noise}")


def main() -> None:
    PARSERS.register("every_turn")(EveryTurnParser)
    ENVIRONMENTS.register("scripted")(ScriptedEpisode)
    train_rl(load_config(RunConfig, sys.argv[1], sys.argv[2:]))


if __name__ == "__main__":
    main()
