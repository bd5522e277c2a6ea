"""The ``repo`` environment: a small Python repository with a planted bug, in the model's hands.

A dataset row (``python -m megarlhf.data.repo_tasks`` writes them) holds the repository (``files``: relative
path -> text), the import that loads it for the tests (``program``, e.g. ``from shapes.core import *``), the
visible call tests (``visible_tests``, also written into the repository as a test file the model can read)
and the hidden ones (``hidden_tests``, never shown). Tools:

* ``list_files()``: the repository's paths;
* ``view(path)``: a file with numbered lines;
* ``edit(path, old, new)``: replaces the one occurrence of the text ``old`` in the file with ``new`` (an
  ``old`` that is missing or occurs more than once is refused, as is a new path);
* ``run_tests()``: the visible tests, run in the code sandbox (:mod:`megarlhf.isolation.sandbox`) on the
  repository as edited so far, reported as the ``code`` environment reports them.

The environment is stateless: the repository a call sees is the row's, with the ``edit`` calls of the
model's earlier turns of the episode replayed (:func:`replay`, with the episode's call format,
``parser``), so its calls run in worker processes the runner can kill. The ``repo_tests`` reward
(:mod:`megarlhf.rewards.repo`) replays the same edits and scores the hidden tests on the result: the
model is paid for the repository it leaves, not for what it says.
"""
from __future__ import annotations

from typing import Any, Sequence

from megarlhf.envs.api import ENVIRONMENTS, Message, StepResult, ToolEpisode, ToolError, ToolSpec, stateless
from megarlhf.envs.parsers import PARSERS
from megarlhf.envs.tool_calls import ParsedCall
from megarlhf.isolation.sandbox import SandboxLimits, check_files, row_tests, run_tests

_TEXT = {"type": "string"}
REPO_TOOLS = [
    ToolSpec("list_files", "Lists the repository's files.", {"type": "object", "properties": {}}),
    ToolSpec("view", "Shows a file of the repository with line numbers.",
             {"type": "object", "required": ["path"], "properties": {"path": _TEXT}}),
    ToolSpec("edit", "Replaces the one occurrence of the text old in a file with the text new.",
             {"type": "object", "required": ["path", "old", "new"],
              "properties": {"path": _TEXT, "old": _TEXT, "new": _TEXT}}),
    ToolSpec("run_tests", "Runs the repository's visible tests and reports which pass.",
             {"type": "object", "properties": {}}),
]


def row_repository(metadata: dict[str, Any]) -> tuple[dict[str, str], str]:
    """The row's files and program, checked; errors name the field."""
    files, program = metadata.get("files"), metadata.get("program")
    try:
        files = check_files(files)
    except ValueError as exc:
        raise ValueError(f"the row's 'files' field: {exc}") from None
    if not files:
        raise ValueError("the row's 'files' field holds no file")
    if not isinstance(program, str):
        raise ValueError(f"the row's 'program' field must be the import the tests run, got {program!r}")
    return dict(files), program


def check_parser(parser: str) -> None:
    """The call formats whose calls survive in the text a reward reads (the model's turns decoded without
    special tokens): ``hermes`` (its tags are text, or added tokens that are not special). Mistral's
    ``[TOOL_CALLS]`` is a special token: a reward could not replay those calls."""
    if parser != "hermes":
        raise ValueError(f"the repo environment and the repo_tests reward replay calls in the 'hermes' format "
                         f"(rollout.env.parser: hermes), got parser {parser!r}")


def apply_edit(files: dict[str, str], path: Any, old: Any, new: Any) -> str:
    """Replaces the one occurrence of ``old`` in ``files[path]`` with ``new`` (in place); returns the
    observation, or raises ToolError saying why not."""
    for name, value in (("path", path), ("old", old), ("new", new)):
        if not isinstance(value, str):
            raise ToolError(f"'{name}' must be a string, got {type(value).__name__}")
    if path not in files:
        raise ToolError(f"no file {path!r} (list_files shows the repository's files)")
    count = files[path].count(old) if old else 0
    if count != 1:
        raise ToolError(f"'old' must occur exactly once in {path}, found {count} times" if old
                        else "'old' must not be empty")
    edited = {**files, path: files[path].replace(old, new, 1)}
    try:
        check_files(edited)  # still what the sandbox takes: its size limit, valid text
    except ValueError as exc:
        raise ToolError(f"the edit is refused: {exc}") from None
    files[path] = edited[path]
    return f"edited {path}"


def replay(files: dict[str, str], turns: Sequence[str], parser: str = "hermes") -> dict[str, str]:
    """``files`` after the ``edit`` calls of ``turns`` (the model's turns, in order; one call per turn, as
    the runner reads them), each applied where it applies and skipped where it was refused."""
    parse = PARSERS.get(parser)(REPO_TOOLS, None)
    files = dict(files)
    for turn in turns:
        call = parse(turn)
        if isinstance(call, ParsedCall) and call.name == "edit":
            try:
                apply_edit(files, **call.arguments)
            except ToolError:
                continue
    return files


def _earlier_turns(messages: Sequence[Message]) -> list[str]:
    """The model's turns of this episode before the current one (those after the last user message)."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    return [m["content"] for m in messages[last_user + 1:-1] if m.get("role") == "assistant"]


class RepoEpisode(ToolEpisode):
    """One episode over a row's repository (module docstring)."""

    def __init__(self, files: dict[str, str], program: str, tests: list, limits: SandboxLimits, parser: str,
                 report_chars: int):
        super().__init__(REPO_TOOLS, {"list_files": self.list_files, "view": self.view, "edit": self.edit,
                                      "run_tests": self.run_tests})
        self.original, self.program, self.tests, self.limits = files, program, tests, limits
        self.parser, self.report_chars = parser, report_chars
        self.files = dict(files)

    def step(self, messages: list[Message], call: ParsedCall) -> StepResult:
        self.files = replay(self.original, _earlier_turns(messages), self.parser)
        return super().step(messages, call)

    def list_files(self) -> str:
        return "\n".join(sorted(self.files))

    def view(self, path: Any) -> str:
        if not isinstance(path, str) or path not in self.files:
            raise ToolError(f"no file {path!r} (list_files shows the repository's files)")
        return "\n".join(f"{n:4d}  {line}" for n, line in enumerate(self.files[path].splitlines(), 1))

    def edit(self, path: Any, old: Any, new: Any) -> str:
        return apply_edit(self.files, path, old, new)

    def run_tests(self) -> str:
        return run_tests(self.program, self.tests, self.limits, files=self.files).report(self.report_chars)


@ENVIRONMENTS.register("repo")
@stateless
def repo_env(metadata: dict, parser: str = "hermes", wall_s: float = 4.0, cpu_s: int = 4, memory_mb: int = 512,
             report_chars: int = 1000, allow_unisolated: bool = False) -> RepoEpisode:
    """An episode over this row's repository and its visible tests (module docstring). ``parser`` is the
    episode's call format (``rollout.env.parser``), with which earlier turns' edits are replayed."""
    check_parser(parser)
    files, program = row_repository(metadata)
    tests = row_tests(metadata, "visible_tests")
    limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, report_chars=report_chars,
                           allow_unisolated=allow_unisolated)
    return RepoEpisode(files, program, tests, limits, parser, report_chars)
