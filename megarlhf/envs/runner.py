"""Runs the tool calls of a batch of episodes, one model turn at a time, each with a time limit.

The rollout loop calls, per batch of samples::

    runner = ToolRunner(env_config, tokenizer)
    handles = runner.start(metadata_per_sample)           # one episode (and parser) per sample
    batch = runner.step(handles_still_running, conversations)   # after each generated turn
    batch.outcomes[i]: TurnOutcome(observation, done, reward, info, call)

For each turn :meth:`ToolRunner.step` parses the last (assistant) message with the episode's parser and:

* no tool call: the episode is done (the turn is the model's answer), no observation. An episode that
  defines ``final_answer(messages) -> StepResult | None`` is given it first (timed like a call, also in the last
  turn): its reward counts, its observation and ``done`` do not (the episode ends), None is no answer;
* a malformed call (:class:`~megarlhf.envs.api.ParseError`): observation ``"error: <why>"``, not done;
* a call: ``episode.step(messages, call)`` runs limited to ``timeout_s`` from the moment it starts:

  - an environment declared :func:`~megarlhf.envs.api.stateless` (the built-ins are): in a worker
    process of a :class:`~megarlhf.isolation.process_pool.TimedProcessPool`, on an episode its factory makes
    afresh for the call from the row's metadata and ``kwargs``. A call past its time, one that holds the
    GIL, exhausts the worker's CPU time, crashes or exits has its worker killed and replaced; nothing is
    left behind (an allocation past ``worker_memory_mb`` raises MemoryError in the call, an error like any
    other). Results come back as JSON, so ``info`` must be JSON data; the observation is cut in the worker.
    A worker that cannot start (the environment does not import by its name there, or the memory limit
    is too small for its imports) stops the run when the runner is made;
  - any other environment keeps its episodes (their state) in this process, and the call runs on a
    thread of a :class:`~megarlhf.isolation.timed_calls.TimedThreadPool` (see its docstring for how a stuck
    thread is abandoned and replaced; a thread cannot stop a call that holds the GIL). While a timed-out
    step is still running in its abandoned thread, further calls on *that* episode are refused ("busy")
    rather than run concurrently on the same state.

  A step that raises, returns something other than a valid :class:`~megarlhf.envs.api.StepResult` (a
  non-string observation, a non-finite reward, ...), or times out becomes the observation
  ``"error: ..."`` plus a :class:`ToolFailure` report; the other samples carry on.

Every observation is cut to ``max_observation_chars`` (a marker saying so included), and an episode is
done after its ``max_turns``-th turn whatever the environment says. A call in that last turn is not run:
the model has no turn left to read its result, and a reward for a result it never saw would teach it to
call tools it cannot use. Its outcome is done, without observation or reward, ``info={"not_run":
"max_turns"}``; an environment that rewards a final "submit" call needs ``max_turns`` to leave a turn for
it. Metrics of one ``step`` (counts, to be summed over the turns of a rollout): ``tools/calls``
(well-formed calls run), ``tools/answers`` (answers an episode's ``final_answer`` took), ``tools/not_run``
(well-formed calls in a last turn), ``tools/errors`` (raised, invalid or busy), ``tools/timeouts``,
``tools/parse_errors``, ``tools/refused`` (calls a tool answered with :class:`~megarlhf.envs.api.ToolError`),
``tools/truncated``; ``tools/abandoned_threads``
(threads stuck right now) and ``tools/killed_workers`` (worker processes killed or found dead since the
runner started).

:meth:`ToolRunner.step` calls an episode's ``close()`` (where it defines one) when the episode is done;
:meth:`ToolRunner.finish` closes the rest of a batch's episodes when the rollout ends.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from megarlhf.config.rollout import EnvConfig
from megarlhf.envs.api import Episode, Message, ParsedCall, ParseError, StepResult, is_stateless, resolve_environment
from megarlhf.envs.parsers import PARSERS, ToolCallParser
from megarlhf.core.errors import ConfigError
from megarlhf.isolation.process_pool import TimedProcessPool
from megarlhf.isolation.timed_calls import TimedCall, TimedThreadPool, is_finite_number, shown

logger = logging.getLogger(__name__)

_SHOWN_CHARS = 200  # model-turn characters kept in a failure report
_LOGGED_FAILURES = 5  # failures logged per step (all are in StepBatch.failures)


@dataclass
class EpisodeHandle:
    """One sample's episode as the runner tracks it."""

    index: int  # the sample's position in the list given to ToolRunner.start
    episode: Episode
    parser: ToolCallParser
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's fields the episode was made from
    turns: int = 0  # model turns seen so far
    done: bool = False
    running: Any = None  # a timed-out call whose abandoned thread may still be inside episode.step
    closed: bool = False  # the episode's close() was called


@dataclass
class TurnOutcome:
    """What follows one model turn. ``observation`` (None when there is none) is to be shown to the
    model as a tool message; ``call`` is what the parser found in the turn (None: no tool call)."""

    observation: str | None
    done: bool
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    call: ParsedCall | ParseError | None = None
    answered: bool = False  # the turn was a final answer the episode's final_answer took


@dataclass
class ToolFailure:
    """A tool call that raised, returned an invalid result, timed out, or found its episode busy."""

    index: int  # the sample's position in the list given to ToolRunner.start
    tool: str
    kind: str  # "error", "invalid", "timeout" or "busy"
    message: str
    turn: str  # the model's turn, truncated

    def __str__(self) -> str:
        return f"tool {self.tool!r} {self.kind} on sample {self.index}: {self.message} (turn {self.turn!r})"


@dataclass
class StepBatch:
    outcomes: list[TurnOutcome]  # one per handle given to step, in order
    failures: list[ToolFailure] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _run_step(episode: Episode, messages: list[Message], call: ParsedCall | None) -> Any:
    if call is not None:
        return episode.step(messages, call)
    result = episode.final_answer(messages)
    if isinstance(result, StepResult):  # an answer ends the episode: its observation and done are not read
        result = StepResult(None, True, result.reward, result.info)
    return result


def takes_answers(episode: Any) -> bool:
    """Whether the episode takes the final answer (a turn without a tool call): it defines ``final_answer``."""
    return callable(getattr(episode, "final_answer", None))


def _close(handle: "EpisodeHandle") -> None:
    """Calls the episode's ``close()`` once, if it defines one; one that raises is logged, never raised (the
    episode's results are already in)."""
    close = getattr(handle.episode, "close", None)
    if handle.closed or not callable(close):
        return
    handle.closed = True
    try:
        close()
    except Exception as exc:  # noqa: BLE001 - user code
        logger.warning("closing the episode of sample %d raised %s: %s", handle.index, type(exc).__name__, exc)


def _called(parsed: ParsedCall | None) -> str:
    return "(answer)" if parsed is None else parsed.name


def stateless_step(name: str):
    """The worker-process side of a stateless environment (the pool's resolver): a function of one call
    ``{"metadata", "kwargs", "messages", "call": {"name", "arguments"}}`` that makes the episode, runs the
    step and returns the result's fields as JSON data, or ``{"problem": what is wrong with it}``."""
    factory = resolve_environment(name)

    def step(item: dict[str, Any]) -> dict[str, Any]:
        episode = factory(item["metadata"], **item["kwargs"])
        call = None if item["call"] is None else ParsedCall(**item["call"])
        result = _run_step(episode, item["messages"], call)
        if result is None and call is None:
            return {"no_answer": True}
        if (problem := _check_result(result)) is not None:
            return {"problem": problem}
        observation, info = result.observation, dict(result.info)
        if observation is not None:  # cut here: the reply must fit its frame, and the parent cuts alike
            observation = fit_observation(result.observation, item["max_chars"])
            if observation != result.observation:
                info["truncated_from"] = len(result.observation)
        reward = None if result.reward is None else float(result.reward)  # e.g. a numpy scalar: JSON takes floats
        return {"observation": observation, "done": result.done, "reward": reward, "info": info}

    step.megarlhf_preload = getattr(factory, "megarlhf_preload", ())
    return step


_RESULT_FIELDS = {"observation", "done", "reward", "info"}


def _reply_result(value: Any) -> tuple[StepResult | None, str | None]:
    """A worker's reply (JSON data from another process: checked again) as a StepResult, or the problem."""
    if isinstance(value, dict) and isinstance(value.get("problem"), str) and len(value) == 1:
        return None, _truncate(value["problem"])
    if not (isinstance(value, dict) and set(value) == _RESULT_FIELDS):
        return None, "sent a reply that is not a step result"
    result = StepResult(**value)
    problem = _check_result(result)
    return (None, problem) if problem is not None else (result, None)


def _check_result(result: Any) -> str | None:
    """None if ``result`` is a valid StepResult, else what is wrong with it."""
    if not isinstance(result, StepResult):
        return f"returned {type(result).__name__}, expected a StepResult"
    if result.observation is not None and not isinstance(result.observation, str):
        return f"returned an observation of type {type(result.observation).__name__}, expected a string"
    if result.observation is None and not result.done:
        return "returned no observation without ending the episode"
    if not isinstance(result.done, bool):
        return f"returned done={shown(result.done)}, expected a bool"
    if result.reward is not None and not is_finite_number(result.reward):
        return f"returned reward={shown(result.reward)}, expected a finite number or None"
    if not isinstance(result.info, dict):
        return f"returned info of type {type(result.info).__name__}, expected a dict"
    return None


class ToolRunner:
    """Starts the episodes of a batch and runs their tool calls (see the module docstring)."""

    def __init__(self, config: EnvConfig, tokenizer: Any = None):
        self.config = config
        self.tokenizer = tokenizer
        self.factory = resolve_environment(config.name)
        self.make_parser = PARSERS.get(config.parser)
        self.stateless = is_stateless(self.factory)
        self.pool = TimedThreadPool(config.num_workers)  # a stateless environment's calls use processes
        self.processes = TimedProcessPool(config.num_workers, f"{__name__}:stateless_step", [config.name],
                                          memory_mb=config.worker_memory_mb)
        if self.stateless and (problem := self.processes.check_start()) is not None:
            self.processes.close()  # refused now: otherwise every call would fail the same way, as observations
            raise ConfigError(f"rollout.env: environment {config.name!r} is declared stateless, so its calls run in "
                              f"worker processes, but {problem} (a worker imports the environment by its registered "
                              f"name or dotted path, within rollout.env.worker_memory_mb={config.worker_memory_mb})")

    def start(self, metadata: Sequence[dict[str, Any]]) -> list[EpisodeHandle]:
        """One episode per sample (``metadata[i]`` is sample i's dataset fields). Errors name the sample."""
        handles = []
        for index, fields in enumerate(metadata):
            try:
                episode = self.factory(dict(fields), **self.config.kwargs)
                tools = list(episode.tools)
                if not callable(getattr(episode, "step", None)):
                    raise TypeError(f"{type(episode).__name__} has no step method")
                parser = self.make_parser(tools, self.tokenizer)
            except Exception as exc:  # user code: report which environment and sample
                raise ValueError(f"environment {self.config.name!r} could not start the episode of sample "
                                 f"{index}: {type(exc).__name__}: {exc}") from exc
            handles.append(EpisodeHandle(index, episode, parser, dict(fields)))
        return handles

    def step(self, handles: Sequence[EpisodeHandle], conversations: Sequence[list[Message]],
             final: Sequence[bool] | None = None) -> StepBatch:
        """Handles the model turn that ends each conversation (see the module docstring). ``final[i]``: episode
        i has no turn after this one whatever ``max_turns`` says (its response budget is spent): it is done, a
        call in it is not run, an answer is."""
        final = [False] * len(handles) if final is None else list(final)
        if not len(handles) == len(conversations) == len(final):
            raise ValueError(f"step got {len(handles)} episodes, {len(conversations)} conversations and "
                             f"{len(final)} final flags")
        outcomes: list[TurnOutcome | None] = [None] * len(handles)
        failures: list[ToolFailure] = []
        calls, slots = [], []
        turns = [self._model_turn(h, m) for h, m in zip(handles, conversations)]  # all checked before any runs
        for slot, (handle, messages, turn) in enumerate(zip(handles, conversations, turns)):
            handle.turns += 1
            last = final[slot] or handle.turns >= self.config.max_turns
            parsed = handle.parser(turn)
            if parsed is None and not takes_answers(handle.episode):
                outcomes[slot] = TurnOutcome(None, True)
            elif isinstance(parsed, ParseError):
                outcomes[slot] = TurnOutcome(self._fit(f"error: {parsed.message}"), False, call=parsed)
            elif parsed is not None and last:  # no turn left to read the result: not run
                why = "max_turns" if handle.turns >= self.config.max_turns else "budget"
                outcomes[slot] = TurnOutcome(None, True, info={"not_run": why}, call=parsed)
            elif handle.running is not None and not handle.running.done:
                message = "the previous tool call of this episode is still running"
                failures.append(ToolFailure(handle.index, _called(parsed), "busy", message, _truncate(turn)))
                outcomes[slot] = TurnOutcome(self._fit(f"error: {message}"), parsed is None, call=parsed)
            else:
                calls.append(self._call(handle, messages, parsed))
                slots.append((slot, parsed))
        pool = self.processes if self.stateless else self.pool
        timed_out = pool.run(calls, self.config.timeout_s)
        for call, (slot, parsed), late in zip(calls, slots, timed_out):
            handle = handles[slot]
            if late and not self.stateless:  # its thread goes on with the episode's state
                handle.running = call
            outcomes[slot], failure = self._outcome(handle, call, parsed, late, turns[slot])
            if failure is not None:
                failures.append(failure)
        for handle, outcome, end in zip(handles, outcomes, final):
            outcome.done = outcome.done or end or handle.turns >= self.config.max_turns
            handle.done = outcome.done
            if handle.done:  # an episode holding a connection or a process releases it as soon as it ends
                _close(handle)
        for failure in failures[:_LOGGED_FAILURES]:
            logger.warning("%s", failure)
        return StepBatch(outcomes, failures, self._metrics(outcomes, failures))

    def _call(self, handle: EpisodeHandle, messages: list[Message], parsed: ParsedCall | None) -> TimedCall:
        """The timed call of a tool call, or of the episode's ``final_answer`` when ``parsed`` is None."""
        messages = [dict(m) for m in messages]
        if not self.stateless:
            return TimedCall(_run_step, handle.episode, {"messages": messages, "call": parsed})
        call = None if parsed is None else {"name": parsed.name, "arguments": parsed.arguments}
        item = {"metadata": handle.metadata, "kwargs": self.config.kwargs, "messages": messages, "call": call,
                "max_chars": self.config.max_observation_chars}
        return TimedCall(self.config.name, item, {})

    def _model_turn(self, handle: EpisodeHandle, messages: list[Message]) -> str:
        if handle.done:
            raise ValueError(f"the episode of sample {handle.index} is done; step only running episodes")
        if not messages or messages[-1].get("role") != "assistant" or not isinstance(messages[-1].get("content"), str):
            raise ValueError(f"the conversation of sample {handle.index} must end with the model's turn "
                             f"({{'role': 'assistant', 'content': str}}), got {messages[-1] if messages else None!r}")
        return messages[-1]["content"]

    def _outcome(self, handle: EpisodeHandle, call: TimedCall, parsed: ParsedCall | None, timed_out: bool,
                 turn: str) -> tuple[TurnOutcome, ToolFailure | None]:
        """The outcome of a tool call, or of an answer (``parsed`` None: the episode ends whatever it says)."""
        no_answer = parsed is None and call.error is None and call.value in (None, {"no_answer": True})
        if no_answer:
            result, problem = None, None
        elif self.stateless:
            result, problem = _reply_result(call.value)
        else:
            result, problem = call.value, _check_result(call.value)
        what = "the answer" if parsed is None else f"tool {parsed.name!r}"
        if timed_out:
            kind, message = "timeout", f"the call of {what} timed out after {self.config.timeout_s} s"
        elif call.error is not None and self.stateless:  # raised in the worker, or the worker died
            kind, message = "error", f"{what} failed: {call.error}"
        elif call.error is not None:
            kind, message = "error", f"{what} raised {type(call.error).__name__}: {call.error}"
        elif no_answer:
            return TurnOutcome(None, True), None
        elif problem is not None:
            kind, message = "invalid", f"{what} {problem}"
        else:
            observation = None if result.observation is None else self._fit(result.observation)
            reward = None if result.reward is None else float(result.reward)
            info = dict(result.info)
            if parsed is None:
                return TurnOutcome(None, True, reward, info, answered=True), None
            if observation != result.observation:
                info["truncated_from"] = len(result.observation)
            return TurnOutcome(observation, result.done, reward, info, parsed), None
        failure = ToolFailure(handle.index, _called(parsed), kind, message, _truncate(turn))
        if parsed is None:
            return TurnOutcome(None, True, info={"failure": kind}), failure
        return TurnOutcome(self._fit(f"error: {message}"), False, info={"failure": kind}, call=parsed), failure

    def _fit(self, text: str) -> str:
        return fit_observation(text, self.config.max_observation_chars)

    def gauges(self) -> dict[str, float]:
        """The runner's state (not per-turn counts): threads stuck, workers killed since it started."""
        return {"tools/abandoned_threads": float(self.pool.abandoned),
                "tools/killed_workers": float(self.processes.killed)}

    def _metrics(self, outcomes: list[TurnOutcome], failures: list[ToolFailure]) -> dict[str, float]:
        return {
            "tools/calls": float(sum(isinstance(o.call, ParsedCall) and "not_run" not in o.info for o in outcomes)),
            "tools/not_run": float(sum("not_run" in o.info for o in outcomes)),
            "tools/errors": float(sum(f.kind != "timeout" for f in failures)),
            "tools/timeouts": float(sum(f.kind == "timeout" for f in failures)),
            "tools/parse_errors": float(sum(isinstance(o.call, ParseError) for o in outcomes)),
            "tools/refused": float(sum("tool_error" in o.info for o in outcomes)),
            "tools/truncated": float(sum("truncated_from" in o.info for o in outcomes)),
            "tools/answers": float(sum(o.answered for o in outcomes)),
            **self.gauges(),
        }

    def finish(self, handles: Sequence[EpisodeHandle]) -> None:
        """Ends the batch's episodes: calls ``close()`` of those that define it and were not closed when they
        ended (an episode the rollout ended itself: its budget, a template failure, an error)."""
        for handle in handles:
            _close(handle)

    def close(self) -> None:
        """Stops the workers (abandoned threads exit when their call returns)."""
        self.pool.close()
        self.processes.close()


def fit_observation(text: str, limit: int) -> str:
    """``text`` as valid text (:func:`valid_text`) cut to ``limit`` characters, the cut marked within that budget."""
    clean = valid_text(text[:limit])  # escapes are longer than the characters they replace
    if len(text) <= limit and len(clean) <= limit:
        return clean
    marker = f" ...[cut: {len(text)} chars]"
    keep = limit - len(marker)
    return clean[:limit] if keep <= 0 else clean[:keep] + marker


def valid_text(text: str) -> str:
    """``text`` with its lone surrogates written as escapes (``\\udc80``): a tool's output or a parse error
    quoting the model's JSON (``"\\udc80"`` decodes to one) can hold them, and no tokenizer encodes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _truncate(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + f"... ({len(text)} chars)"
