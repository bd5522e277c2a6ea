"""Multi-turn, tool-calling rollouts: generate a turn, run the tool it calls, append the observation, go on.

One sample is one episode of ``rollout.env`` (:mod:`megarlhf.envs`). :class:`MultiTurnRollout` drives a
batch of episodes over a *turn generator* ``generate(prompts, sampling) -> RolloutBatch`` (the process's
own engine: a colocated rank's, or an engine rank's in the disaggregated placement), which it calls once
per turn for the episodes still running:

1. turn 1 samples ``sampling.n`` responses per prompt, exactly as a single-turn rollout does;
2. each turn's text is parsed for a tool call (the episode's parser, ``rollout.env.parser``) and
   :class:`megarlhf.envs.runner.ToolRunner` runs it (time-bounded; failures become observations and
   per-sample reports, never exceptions);
3. an episode goes on while its turn called a tool, it has turns left (``env.max_turns``) and the
   observation fits the token budget (``rollout.response_budget``); its next turn is generated from
   the prompt + everything so far, at most ``rollout.max_new_tokens`` new tokens. A turn cut at that
   limit is parsed like any other (a complete call in it runs; without one the episode ends, its
   finish reason "length").

The response of a sample is all its turns and observations in order. ``loss_masks`` marks the model's
tokens (1) and the observation tokens (0): observations carry no loss and no log-prob (0.0), so the
trainer's log-probs and the step-0 gate cover model-generated tokens only.

Observation tokens. Chat mode (the prompt rendered with the tokenizer's chat template): the conversation
is re-rendered with the tool's message (``{"role": "tool", ...}``) and a generation prompt, and the
observation is the text between the end of the model's turn and the next generation prompt's end, i.e.
exactly what the template puts there (the end-of-turn marker when the turn stopped on a tool-call token,
the tool turn, the assistant header); every rendering passes the ``tools=`` the prompt was rendered with
(:mod:`megarlhf.envs.prompting`). Plain mode: ``\\n<tool_response>\\n{observation}\\n</tool_response>\\n``.

Seeds: turn 1 uses the single-turn seeds (``sampling.prompt_seed(p) + j``); turn ``t`` of that episode
uses that seed + ``t * TURN_STRIDE`` (:mod:`megarlhf.core.seeds`), so every episode's samples depend on the
run seed, the step and its position only, not on which other episodes are still running or where it is
generated.

Environment rewards (``StepResult.reward``) are summed per episode (``env_rewards``) and, in training,
join the sample's reward. Metrics (counts, summed over turns): the runner's ``tools/*``, ``tools/samples``,
``tools/samples_calling`` (samples that called a tool at least once) and ``tools/turns``.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from jinja2 import TemplateError

from megarlhf.data.prompts import PROBE_TOOL, PromptExample, template_renders_tools
from megarlhf.config.rollout import EnvConfig
from megarlhf.envs.api import ParsedCall
from megarlhf.envs.parsers import PARSERS, added_tokens
from megarlhf.envs.prompting import tool_schemas
from megarlhf.envs.runner import ToolRunner, takes_answers
from megarlhf.core.errors import ConfigError, EpisodeFailureBudgetError
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.rollout.engines.routing import merge_turns, unrouted
from megarlhf.core.seeds import TURN_STRIDE

logger = logging.getLogger(__name__)

# model turns the start-up probe renders: a trailing newline (templates that trim), reasoning tags (templates
# that strip or move reasoning)
_PROBE_TURNS = ("Let me use a tool.\n", "<think>\nThe tool will know.\n</think>\n\nLet me use a tool.")

RUNNER_METRICS = ("tools/calls", "tools/not_run", "tools/errors", "tools/timeouts", "tools/parse_errors",
                  "tools/refused", "tools/truncated", "tools/answers", "tools/abandoned_threads",
                  "tools/killed_workers", "tools/failed_episodes")
TurnGenerator = Callable[[list[list[int]], SamplingConfig], RolloutBatch]


@dataclass
class _Episode:
    prompt: int  # index into the prompts of the call
    seed: int | None  # turn-1 seed of this sample
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    finish: str = "stop"
    reward: float = 0.0
    turns: int = 0
    calls: int = 0
    turn_ids: list[int] = field(default_factory=list)  # the last turn's tokens
    routing: object = None  # the routing record so far (routing replay r3; megarlhf.rollout.engines.routing), else None
    tools: list[dict] | None = None  # the tool schemas its prompt was rendered with (the template's tools=)


class MultiTurnRollout:
    """Runs multi-turn episodes for one rank's prompts (see the module docstring)."""

    def __init__(self, config: EnvConfig, tokenizer, chat: bool, max_new_tokens: int, budget: int):
        self.config, self.tokenizer, self.chat = config, tokenizer, chat
        self.max_new_tokens, self.budget = max_new_tokens, budget
        self.runner = ToolRunner(config, tokenizer)
        self.failures: list[str] = []  # why each failed episode of the run ended (rollout.env.failed_episodes_budget)
        parser = PARSERS.get(config.parser)([], tokenizer)
        # a turn also ends on the format's end-of-call token, where the tokenizer has one (e.g. Qwen2.5's
        # </tool_call>): the observation then follows the call directly
        self.call_end_ids = parser.stop_token_ids
        # special tokens a turn's text drops (the end of turn) and those it keeps for the parser (Mistral's
        # [TOOL_CALLS]): a call behind a special marker is invisible in a plain decode
        self.kept_special_ids = set(parser.special_marker_ids)
        special = {i for i, is_special in added_tokens(tokenizer).values() if is_special}
        self.dropped_special_ids = (special | set(tokenizer.all_special_ids)) - self.kept_special_ids
        # tools= go to the template only where it renders them (one that rejects them got them as text)
        self.template_tools = chat and config.describe_tools and template_renders_tools(tokenizer)
        if chat:
            self._check_template()

    def run(self, generate: TurnGenerator, prompts: Sequence[PromptExample], sampling: SamplingConfig
            ) -> tuple[RolloutBatch, dict[str, float]]:
        """The batch of whole episodes (prompt-major, ``loss_masks`` and ``env_rewards`` filled) and the
        tool metrics. ``generate`` is this process's own engine (a colocated rank's, or an engine rank's in
        the disaggregated placement): nothing here is collective."""
        sampling = replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids) + tuple(self.call_end_ids))
        turn = generate([p.prompt_ids for p in prompts], sampling)
        episodes = [_Episode(p, None if sampling.prompt_seed(p) is None else sampling.prompt_seed(p) + j,
                             messages=self._start_messages(prompts[p]), tools=prompts[p].tools)
                    for p, j in _sample_positions(turn, sampling.n)]
        handles = self.runner.start([prompts[e.prompt].episode_fields for e in episodes])
        _check_described_tools(episodes, handles, prompts)
        sums = {**dict.fromkeys(RUNNER_METRICS, 0.0), **self.runner.gauges()}
        running = list(range(len(episodes)))
        try:
            while True:
                self._take_turns([episodes[i] for i in running], turn)
                running = self._run_tools(episodes, handles, running, sums)
                if not running:
                    break
                turn = generate([prompts[episodes[i].prompt].prompt_ids + episodes[i].response for i in running],
                                self._turn_sampling(sampling, [episodes[i] for i in running]))
        finally:
            self.runner.finish(handles)
        return self._batch(prompts, episodes), self._metrics(episodes, sums)

    def _turn_sampling(self, sampling: SamplingConfig, running: list[_Episode]) -> SamplingConfig:
        """One sample per running episode, each with its own turn seed, within every episode's budget."""
        seeds = None
        if sampling.seed is not None or sampling.prompt_seeds is not None:
            seeds = tuple(e.seed + e.turns * TURN_STRIDE for e in running)
        # the largest room of any episode: each turn is then cut at its own episode's room (_take_turns),
        # so that an episode's tokens do not depend on which others are running
        room = max((self._room(e) for e in running), default=self.max_new_tokens)
        return replace(sampling, n=1, seed=None, prompt_seeds=seeds, max_new_tokens=max(1, room))

    def _room(self, episode: _Episode) -> int:
        """New tokens the episode's next turn may have: the per-turn limit, within its response budget."""
        return min(self.max_new_tokens, self.budget - len(episode.response))

    def _check_template(self) -> None:
        """Renders probe conversations (a model turn that ends in a newline, one with reasoning tags, each then
        a tool message) the way every turn will be, so that a template that rewrites the model's text (trims
        it, adds or strips reasoning as DeepSeek-R1's does at ``</think>``) stops the run at start-up rather
        than failing episodes in the middle of a rollout."""
        tools = [PROBE_TOOL] if self.template_tools else None
        for turn in _PROBE_TURNS:
            probe = _Episode(prompt=0, seed=None, messages=[{"role": "user", "content": "probe"},
                                                             {"role": "assistant", "content": turn}],
                             turn_ids=self.tokenizer.encode(turn, add_special_tokens=False), tools=tools)
            try:
                self._observation_ids(probe, "probe observation")
            except (ValueError, TemplateError) as exc:  # TemplateError: the template refuses a tool message
                raise ConfigError(f"rollout.env: the tokenizer's chat template cannot run multi-turn episodes: "
                                  f"{exc} (checked at start-up on a probe conversation whose model turn is "
                                  f"{turn!r})") from None

    # ---- one turn ------------------------------------------------------------------------------------
    def _start_messages(self, prompt: PromptExample) -> list[dict[str, str]]:
        if prompt.messages is not None:
            return [dict(m) for m in prompt.messages]
        return [{"role": "user", "content": prompt.prompt}]

    def _take_turns(self, episodes: list[_Episode], batch: RolloutBatch) -> None:
        if len(batch.response_ids) != len(episodes):
            raise RuntimeError(f"multi-turn rollout: the engine returned {len(batch.response_ids)} turns for "
                               f"{len(episodes)} running episodes")
        records = batch.routed_experts or [None] * len(episodes)
        for episode, context, turn, lps, finish, record in zip(episodes, batch.prompt_ids, batch.response_ids,
                                                               batch.logprobs, batch.finish_reasons, records):
            room = self._room(episode)
            if len(turn) > room:  # generated for a neighbour's larger room: the same tokens, cut at this one's
                turn, lps, finish = turn[:room], lps[:room], "length"
            if record is not None:  # the call's prompt was the episode so far: its tokens keep their first routing
                episode.routing = merge_turns(episode.routing, record[:len(context) + len(turn)])
            episode.response += list(turn)
            episode.logprobs += list(lps)
            episode.mask += [1] * len(turn)
            episode.finish, episode.turns = finish, episode.turns + 1
            episode.messages.append({"role": "assistant", "content": self._turn_text(turn)})
            episode.turn_ids = list(turn)

    def _run_tools(self, episodes: list[_Episode], handles, running: list[int], sums: dict[str, float]) -> list[int]:
        """Runs the tools of the turns just taken; returns the episodes that go on. A turn cut by the
        per-turn limit is still parsed (a complete call in it runs); an episode whose response filled the
        budget ends there, truncated (its turn still goes to an environment that takes final answers)."""
        live, final = [], []
        for i in running:
            full = len(episodes[i].response) >= self.budget
            if full:
                episodes[i].finish = "length"
            if not full or takes_answers(handles[i].episode):
                live.append(i)
                final.append(full)
        if not live:
            return []
        step = self.runner.step([handles[i] for i in live], [episodes[i].messages for i in live], final)
        for name, value in step.metrics.items():
            gauge = name in ("tools/abandoned_threads", "tools/killed_workers")  # states, not counts per turn
            sums[name] = value if gauge else sums.get(name, 0.0) + value
        going = []
        for i, outcome in zip(live, step.outcomes):
            episode = episodes[i]
            episode.calls += isinstance(outcome.call, ParsedCall) and "not_run" not in outcome.info
            episode.reward += outcome.reward or 0.0
            if outcome.done or outcome.observation is None:
                continue
            try:
                observation = self._observation_ids(episode, outcome.observation)
            except Exception as exc:  # noqa: BLE001 - the model's output broke the template: ends this episode
                self._fail(episode, exc, prompt_index=i)
                sums["tools/failed_episodes"] += 1.0
                continue
            if len(episode.response) + len(observation) + 1 > self.budget:
                episode.finish = "length"
                continue
            episode.response += observation
            episode.logprobs += [0.0] * len(observation)
            episode.mask += [0] * len(observation)
            episode.messages.append({"role": "tool", "content": outcome.observation})
            going.append(i)
        return going

    def _fail(self, episode: _Episode, exc: Exception, prompt_index: int) -> None:
        """Ends ``episode`` with finish reason "error" (model output is an episode's outcome, never a run's):
        logged, counted, and past ``rollout.env.failed_episodes_budget`` over the run, the run stops."""
        episode.finish = "error"
        message = f"episode {prompt_index} (turn {episode.turns}) ended in an error: {type(exc).__name__}: {exc}"
        self.failures.append(message[:500])
        logger.warning("%s", message[:500])
        if len(self.failures) > self.config.failed_episodes_budget:
            raise EpisodeFailureBudgetError(
                f"rollout.env.failed_episodes_budget={self.config.failed_episodes_budget}: {len(self.failures)} "
                f"multi-turn episodes of this run ended in an error (the model's output broke the chat template or "
                f"the tokenizer), the first: {'; '.join(self.failures[:3])}")

    def _decode(self, ids: list[int], special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special)

    def _turn_text(self, ids: list[int]) -> str:
        """The model turn's text as the parser and the chat template see it: special tokens dropped except
        the tool-call markers that are special tokens."""
        if not self.kept_special_ids:
            return self._decode(ids, special=False)
        return self._decode([t for t in ids if t not in self.dropped_special_ids], special=True)

    def _observation_ids(self, episode: _Episode, observation: str) -> list[int]:
        if not self.chat:
            text = f"\n<tool_response>\n{observation}\n</tool_response>\n"
            return self.tokenizer.encode(text, add_special_tokens=False)
        tools = {"tools": episode.tools} if self.template_tools and episode.tools is not None else {}  # as the prompt
        template = functools.partial(self.tokenizer.apply_chat_template, tokenize=False, **tools)
        before, turn = episode.messages[:-1], episode.messages[-1]
        head = template(before, add_generation_prompt=True)
        closed = template(before + [turn])
        full = template(before + [turn, {"role": "tool", "content": observation}], add_generation_prompt=True)
        if not (closed.startswith(head + turn["content"]) and full.startswith(closed)):
            raise ValueError("the chat template does not render the conversation incrementally (the model's turn "
                             "re-rendered differs from its text, or adding a tool message changes earlier "
                             "turns): multi-turn rollouts need a template that appends turns")
        closing = closed[len(head) + len(turn["content"]):]  # what the template writes after the turn
        generated_tail = self._decode(episode.turn_ids, special=True)[len(turn["content"]):]
        if generated_tail and closing.startswith(generated_tail):
            closing = closing[len(generated_tail):]  # the model already wrote the end-of-turn marker
        return self.tokenizer.encode(closing + full[len(closed):], add_special_tokens=False)

    # ---- results -------------------------------------------------------------------------------------
    def _batch(self, prompts: Sequence[PromptExample], episodes: list[_Episode]) -> RolloutBatch:
        batch = RolloutBatch()
        for e in episodes:
            batch.prompt_index.append(e.prompt)
            batch.prompt_ids.append(list(prompts[e.prompt].prompt_ids))
            batch.response_ids.append(e.response)
            batch.logprobs.append(e.logprobs)
            batch.finish_reasons.append(e.finish)
            batch.loss_masks.append(e.mask)
            batch.env_rewards.append(e.reward)
            batch.tool_calls.append(e.calls)
            if e.routing is not None:  # observations after the last call were never routed
                total = len(prompts[e.prompt].prompt_ids) + len(e.response)
                batch.routed_experts.append(torch.cat([e.routing[:total],
                                                       unrouted(total - min(total, e.routing.shape[0]),
                                                                *e.routing.shape[1:])]))
        return batch

    def _metrics(self, episodes: list[_Episode], sums: dict[str, float]) -> dict[str, float]:
        """Counts (the same keys whatever happened, so that ranks can sum them)."""
        return {**sums, "tools/samples": float(len(episodes)),
                "tools/samples_calling": float(sum(e.calls > 0 for e in episodes)),
                "tools/turns": float(sum(e.turns for e in episodes))}

    def close(self) -> None:
        self.runner.close()


def _check_described_tools(episodes: list[_Episode], handles, prompts: Sequence[PromptExample]) -> None:
    """Each episode offers the tools its prompt describes (an environment whose tools change between the
    prompt's rendering and the rollout would have the model call tools it was never shown)."""
    for episode, handle in zip(episodes, handles):
        if episode.tools is not None and tool_schemas(handle.episode.tools) != episode.tools:
            offered = [spec.name for spec in handle.episode.tools]
            described = [schema["function"]["name"] for schema in episode.tools]
            raise ValueError(f"the episode of data row {prompts[episode.prompt].index} offers tools {offered} "
                             f"that differ from those its prompt describes ({described}): an environment's tools "
                             f"must depend on the row only")


def _sample_positions(batch: RolloutBatch, n: int) -> list[tuple[int, int]]:
    """(prompt, sample number) of every sample of a turn-1 batch (prompt-major, n per prompt)."""
    seen: dict[int, int] = {}
    positions = []
    for p in batch.prompt_index:
        positions.append((p, seen.get(p, 0)))
        seen[p] = seen.get(p, 0) + 1
    return positions
