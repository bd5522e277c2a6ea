"""The engine ranks of the disaggregated placement: one rollout engine each, serving the trainers' commands.

An engine rank holds no Megatron state. Its engine is built with ``in_process=False``: it must not join
the job's process groups (an in-process vLLM engine's start-up is collective over the default group), so
vLLM runs its engine core in a child process and each weight bucket reaches it as a handle to the shared
memory the bucket was received into. Weights are loaded in one load session per sync and verified against
the source's predicted fingerprints; the probe, the calibration's checks and generation run as the
trainers ask (:mod:`.protocol`). With ``rollout.env`` the rank runs its share's whole multi-turn episodes,
so a tool runs once per call whatever the trainers' layout.

Engines that die are replaced (:class:`Restarts`, ``rollout.placement.max_engine_restarts``): every call into
the engine after start-up (a sync's loads, the probe, a generation) runs in a thread while the rank watches the
engine's health (and, generating with ``engine_timeout_s``, the clock: an engine that stops answering is
killed). An engine found dead is rebuilt from ``model.path``: before a sync it then loads the weights being
sent, like any engine; during a sync's load or its probe the verdict's metric says :data:`RESTARTED` and the
trainers send everything again; during a generation its share comes back empty with the status ``restarted``,
and the trainers sync the new engine (verified) and send that share again
(:meth:`~megarlhf.rollout.disaggregated.trainer_side.RemoteEngines.receive`). An engine that cannot be
replaced stops every rank naming its rank (:class:`EngineFailedError`; at a sync, the sync's verdict).
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable

from megarlhf.rollout.disaggregated.protocol import Channel
from megarlhf.rollout.engines.api import RolloutEngine
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.rollout.sync.adapters import SLOTS_CHECK, AdapterDirectory, load_problems, slot_problems
from megarlhf.rollout.sync.calibration import CHECKPOINT_CHECK, checkpoint_problems
from megarlhf.rollout.sync.weights import SYNC_CHECK, compare_fingerprints, probe_floor, probe_problems


RESTARTS_METRIC = "rollout/engine_restarts"  # engines replaced so far in the run (all engine ranks)


@dataclass(frozen=True)
class Restarts:
    """How an engine rank replaces a dead engine: ``rebuild`` makes a fresh one (from ``model.path``), at most
    ``limit`` times in a run; a generation that has not returned after ``timeout_s`` (0: never) is a dead
    engine too (its processes are killed). ``poll_s``: how often the engine of a running call is checked."""

    rebuild: Callable[[], RolloutEngine] | None = None
    limit: int = 0
    timeout_s: float = 0.0
    poll_s: float = 0.5


class EngineServer:
    """One engine rank: :meth:`serve` executes the source's commands until it says stop. ``multi_turn`` runs
    whole episodes (None: single-turn runs); ``adapter_only``: LoRA adapters arrive instead of weights;
    ``restarts``: how a dead engine is replaced (default: never)."""

    def __init__(self, channel: Channel, engine: RolloutEngine, multi_turn=None, adapter_only: bool = False,
                 restarts: Restarts = Restarts()):
        self.channel, self.engine, self.multi_turn = channel, engine, multi_turn
        self.adapter_directory = AdapterDirectory() if adapter_only else None
        self.restarts, self.restarted = restarts, 0
        self.unkillable = False  # a generation timed out on an engine that runs in this process
        self.handlers = {"sync": self._sync, "adapter": self._adapter, "layout": self._layout,
                         "checkpoint": self._checkpoint, "calibrate": self._calibrate, "generate": self._generate}

    def serve(self) -> None:
        """Runs commands until ``stop``. A failed sync raises :class:`WeightSyncError` here after the trainers
        were told."""
        while True:
            command = self.channel.broadcast()
            if command[0] == "stop":
                if self.multi_turn is not None:
                    self.multi_turn.close()
                self.engine.close()
                return
            if command[0] not in self.handlers:
                raise RuntimeError(f"disaggregated engine rank: unknown command {command[0]!r} from the source")
            self.handlers[command[0]](*command[1:])

    def _layout(self, hf_shapes: dict[str, tuple[int, ...]]) -> None:
        self.channel.from_engines((self.engine.fused_parameters(), self.engine.placement(hf_shapes)))

    def _sync(self) -> None:
        """Loads the weights being sent. A dead engine found first is replaced (its replacement loads them);
        one that dies during the load is replaced after the stream is drained, and the verdict's metric tells
        the trainers to send everything again (:data:`RESTARTED`)."""
        problems, died = self._replace_if_dead(), None
        if not problems:
            try:
                self._call(self.engine.begin_load)
            except EngineDied as death:
                died = death.why
        while (bucket := self.channel.receive_bucket()) is not None:
            if problems or died:
                continue  # drained unread, to reach the verdict
            try:
                self._call(lambda: self.engine.load_bucket(bucket))
            except EngineDied as death:
                died = death.why
            except Exception as err:  # keep draining the stream so that every rank reaches the verdict
                problems.append(f"the engine failed to load the bucket with {bucket.meta[0][0]}...: {err}")
        expected = self.channel.broadcast()  # the source's expected fingerprints
        if not (problems or died):
            try:
                problems += compare_fingerprints(expected, self._call(self.engine.finish_load))
            except EngineDied as death:
                died = death.why
        self.channel.engine_verdict(problems, SYNC_CHECK, metric=self._after_death(died, problems))
        self._probe()

    def _adapter(self, adapter_config: dict) -> None:
        """Adapter-only sync: one bucket of PEFT tensors, written and loaded as the engine's adapter, its
        slots compared with the source's prediction (megarlhf.rollout.sync.adapters); then the probe."""
        problems = self._replace_if_dead()  # a fresh engine holds model.path: the adapters' base
        bucket, report, died = self.channel.receive_bucket(), {}, None
        if not problems and bucket is None:
            problems = ["the source sent no adapter tensors"]
        elif not problems:
            try:
                report, problems = self._call(lambda: load_problems(self.adapter_directory, self.engine,
                                                                    dict(bucket.tensors()), adapter_config))
            except EngineDied as death:
                died = death.why
        expected = self.channel.broadcast()  # the source's expected slots
        if not (problems or died):
            problems = slot_problems(expected, report)
        self.channel.engine_verdict(problems, SLOTS_CHECK, metric=self._after_death(died, problems))
        self._probe()

    def _probe(self) -> None:
        probe, gaps, problems = self.channel.broadcast(), (float("nan"), float("nan")), []
        if probe is not None:
            ids, trainer, tolerances = probe
            try:
                logprobs = self._call(lambda: self.engine.prompt_logprobs(ids))
            except EngineDied as death:
                gaps = self._after_death(death.why, problems)
            else:
                worst, mean, problems = probe_problems(trainer, logprobs, tolerances)
                gaps = (worst, mean)
        self.channel.engine_verdict(problems, "probe forward", metric=gaps)

    def _after_death(self, why: str | None, problems: list[str]):
        """After an engine died during a load or the probe (``why``; None: it did not): replaced, the verdict's
        metric :data:`RESTARTED` (the trainers send everything again); else the problem is added."""
        if why is None:
            return None
        failed = self._replace(why)
        problems += failed
        return None if failed else RESTARTED

    def _checkpoint(self, expected: dict[str, tuple[int, int]]) -> None:
        """The calibration's bitwise check: the engine reloads model.path from disk and compares."""
        self.channel.engine_verdict(checkpoint_problems(expected, self.engine.checkpoint_report()), CHECKPOINT_CHECK)

    def _calibrate(self, probe: list[list[int]], trainer) -> None:
        self.channel.from_engines(probe_floor(trainer, self.engine.prompt_logprobs(probe)))

    def _generate(self, prompts: list, sampling: SamplingConfig, episodes: bool) -> None:
        """This engine rank's share of a request (round-robin over the engine ranks): samples of token-id
        prompts, or (``episodes``) whole multi-turn episodes of PromptExamples, with their tool counts. The
        reply's status is None, ``("restarted", why)`` (the engine died during the share and was replaced: no
        samples; the trainers sync the new one and ask again) or ``("failed", why)`` (it could not be
        replaced: every rank stops)."""
        ranks = self.channel.engine_ranks
        mine = list(range(ranks.index(self.channel.rank), len(prompts), len(ranks)))
        samples, tools, start, status = [], {}, time.perf_counter(), None
        if mine:
            share, local = [prompts[i] for i in mine], sampling.for_prompts(mine)
            run = ((lambda: self.multi_turn.run(self.engine.generate, share, local)) if episodes
                   else (lambda: (self.engine.generate(share, local), {})))
            result, dead = self._watched(run, self.restarts.timeout_s)
            if dead is not None:
                problems = self._replace(dead)
                status = ("failed", problems[0]) if problems else ("restarted", dead)
            else:
                batch, tools = result
                samples = _samples(batch, mine, episodes)
        tools = {**tools, RESTARTS_METRIC: float(self.restarted)}  # summed over the engines by the source
        self.channel.from_engines((samples, time.perf_counter() - start, tools, status))
        if status is not None and status[0] == "failed":
            raise EngineFailedError(f"engine rank {self.channel.rank}: {status[1]}")

    def _call(self, call: Callable):
        """``call()`` on the engine, watched (:meth:`_watched`, no timeout): raises :class:`EngineDied`."""
        result, dead = self._watched(call, timeout=0.0)
        if dead is not None:
            raise EngineDied(dead)
        return result

    def _watched(self, call: Callable, timeout: float = 0.0) -> tuple[object, str | None]:
        """``call()`` (a generation, a load, the probe) in a thread while this thread watches the engine: (its
        result, None), or (None, why) when the engine died, or stopped answering within ``timeout`` seconds (0:
        no limit; then its processes are killed), first; the thread is left behind. An exception raised by a
        healthy engine is raised here."""
        box: dict = {}

        def run():
            try:
                box["result"] = call()
            except BaseException as err:  # noqa: BLE001 - handed to the watching thread
                box["error"] = err

        thread = threading.Thread(target=run, name="engine-call", daemon=True)
        thread.start()
        started = time.monotonic()
        while True:
            thread.join(self.restarts.poll_s)
            health = self.engine.health()
            if not health.ok:
                return None, health.detail
            if not thread.is_alive():
                if "error" in box:
                    raise box["error"]
                return box["result"], None
            if timeout and time.monotonic() - started > timeout:
                self.engine.kill()
                if self.engine.health().ok:  # nothing of its own to kill: it still runs in this process
                    self.unkillable = True
                return None, f"no answer within rollout.placement.engine_timeout_s={timeout:g} s"

    def _replace_if_dead(self) -> list[str]:
        health = self.engine.health()
        return [] if health.ok else self._replace(health.detail)

    def _replace(self, why: str) -> list[str]:
        """Replaces the dead engine by a fresh one; the problem (one line) when that cannot be done."""
        limit = self.restarts.limit
        if self.unkillable:
            return [f"the engine stopped answering ({why}) and runs in this rank's own process: it cannot be killed, "
                    f"so it is not replaced (a second engine would compete with it)"]
        if self.restarts.rebuild is None or self.restarted >= limit:
            return [f"the engine died ({why}) and may not be replaced again (rollout.placement.max_engine_restarts="
                    f"{limit}, {self.restarted} used)"]
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - a dead engine's close may fail; its replacement matters
            pass
        try:
            self.engine = self.restarts.rebuild()
        except Exception as err:  # noqa: BLE001 - every rank stops with it
            return [f"the engine died ({why}) and a new one could not be started: {type(err).__name__}: {err}"]
        self.restarted += 1
        print(f"engine rank {self.channel.rank}: the engine died ({why}); replaced it "
              f"({self.restarted} of {limit} restarts)", flush=True)
        return []


class EngineFailedError(RuntimeError):
    """An engine died and could not be replaced; the message names its rank."""


class EngineDied(Exception):
    """The engine died (or stopped answering) during a call; ``why`` says how."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


RESTARTED = "restarted"  # a verdict's metric: the engine was replaced during a load or the probe


def _samples(batch, mine: list[int], episodes: bool) -> list[tuple]:
    """The reply's samples: (prompt's index in the request, response, log-probs, finish, loss mask, env
    reward, tool calls, routing record), the episode fields None for single turns."""
    extras = (zip(batch.loss_masks, batch.env_rewards, batch.tool_calls) if episodes
              else itertools.repeat((None, None, None)))  # (loss mask, env reward, tool calls) of an episode
    routing = batch.routed_experts or itertools.repeat(None)  # routing records (replay r3)
    return [(mine[p], r, lp, f, *extra, record) for p, r, lp, f, extra, record in
            zip(batch.prompt_index, batch.response_ids, batch.logprobs, batch.finish_reasons, extras, routing)]
