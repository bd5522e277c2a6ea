"""An engine rank's watch over its engine (EngineServer._watched) and its replacement (_replace), with stand-in
engines: a generation that returns, one that raises on a healthy engine, one whose engine dies while it runs, and
one that stops answering (killed at rollout.placement.engine_timeout_s); replacements up to the limit, and a
rebuild that fails, each named in one line."""
import threading
import time
from types import SimpleNamespace

import pytest

from megarlhf.rollout.disaggregated.engine_side import EngineServer, Restarts
from megarlhf.rollout.engines.api import EngineHealth


class StandIn:
    """What EngineServer uses of an engine: health, kill, close."""

    def __init__(self):
        self.alive, self.killed, self.closed = True, False, False

    def health(self) -> EngineHealth:
        return EngineHealth(self.alive, "" if self.alive else "EngineCore_0 exit code -9")

    def kill(self) -> None:
        self.killed, self.alive = True, False

    def close(self) -> None:
        self.closed = True


def _server(engine, **restarts) -> EngineServer:
    channel = SimpleNamespace(rank=3, engine_ranks=[2, 3])
    return EngineServer(channel, engine, restarts=Restarts(**{"poll_s": 0.01, **restarts}))


def test_a_generation_on_a_healthy_engine_returns_or_raises_as_it_would():
    server = _server(StandIn())
    assert server._watched(lambda: "samples") == ("samples", None)
    with pytest.raises(ValueError, match="bad prompt"):
        server._watched(lambda: (_ for _ in ()).throw(ValueError("bad prompt")))


def test_an_engine_that_dies_during_a_generation_is_reported_without_waiting_for_it():
    engine, release = StandIn(), threading.Event()

    def stuck():
        engine.alive = False  # its core died: the call would block on it
        release.wait(10)
        return "too late"

    start = time.monotonic()
    assert _server(engine)._watched(stuck) == (None, "EngineCore_0 exit code -9")
    assert time.monotonic() - start < 5
    release.set()


def test_an_engine_that_stops_answering_is_killed_at_the_timeout():
    engine, release = StandIn(), threading.Event()
    result, why = _server(engine, timeout_s=0.2)._watched(lambda: release.wait(10), timeout=0.2)
    release.set()
    assert result is None and engine.killed
    assert why == "no answer within rollout.placement.engine_timeout_s=0.2 s"


def test_replacements_up_to_the_limit_then_a_problem_naming_it():
    built = []

    def rebuild():
        built.append(StandIn())
        return built[-1]

    first = StandIn()
    server = _server(first, rebuild=rebuild, limit=2)
    assert server._replace("EngineCore_0 exit code -9") == [] and server.engine is built[0] and first.closed
    assert server._replace("again") == [] and server.restarted == 2
    assert server._replace("a third time") == [
        "the engine died (a third time) and may not be replaced again (rollout.placement.max_engine_restarts=2, "
        "2 used)"]
    assert _server(StandIn())._replace("x")[0].startswith("the engine died (x) and may not be replaced again")


def test_a_rebuild_that_fails_is_a_problem_naming_its_error():
    def rebuild():
        raise OSError("no memory for the KV cache")

    assert _server(StandIn(), rebuild=rebuild, limit=1)._replace("EngineCore_0 exit code -9") == [
        "the engine died (EngineCore_0 exit code -9) and a new one could not be started: OSError: no memory for "
        "the KV cache"]


def test_placement_restart_settings_are_checked():
    from megarlhf.config.rollout import RolloutPlacementConfig
    from megarlhf.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_engine_restarts must be an int >= 0, got -1"):
        RolloutPlacementConfig(max_engine_restarts=-1)
    with pytest.raises(ConfigError, match=r"engine_timeout_s must be a number of seconds >= 0"):
        RolloutPlacementConfig(engine_timeout_s=float("inf"))


class ScriptedChannel:
    """The engine rank's end of a sync as the source drives it: two buckets, the expected fingerprints, a
    verdict (recorded, not raised)."""

    rank, engine_ranks = 3, [2, 3]

    def __init__(self):
        self.buckets = ["bucket 1", "bucket 2", None]
        self.verdicts = []

    def receive_bucket(self):
        return self.buckets.pop(0)

    def broadcast(self, obj=None):
        return {}  # the source's expected fingerprints

    def engine_verdict(self, problems, what, metric=None):
        self.verdicts.append((list(problems), what))


class DeadOnArrival(StandIn):
    """A dead engine core: every call into it raises, as vLLM's does."""

    def __init__(self):
        super().__init__()
        self.alive = False

    def begin_load(self):
        raise RuntimeError("EngineDeadError")

    load_bucket = finish_load = begin_load


def test_a_dead_engine_that_may_not_be_replaced_at_a_sync_drains_the_stream_and_reports_the_verdict():
    """Not an exception out of the serve loop (the trainers would wait in their broadcast): the buckets are
    read and dropped, and the verdict every rank raises together names the problem."""
    channel = ScriptedChannel()
    server = EngineServer(channel, DeadOnArrival(), restarts=Restarts(limit=0))
    server._probe = lambda: None  # the verdict is what is checked here
    server._sync()
    assert channel.buckets == [] and len(channel.verdicts) == 1
    problems, _ = channel.verdicts[0]
    assert problems == ["the engine died (EngineCore_0 exit code -9) and may not be replaced again "
                        "(rollout.placement.max_engine_restarts=0, 0 used)"]


def test_an_engine_in_this_process_that_stops_answering_is_not_replaced():
    class InProcess(StandIn):
        def kill(self):  # nothing of its own to kill
            pass

    engine, release = InProcess(), threading.Event()
    server = _server(engine, timeout_s=0.1, rebuild=StandIn, limit=2)
    _, why = server._watched(lambda: release.wait(10), timeout=0.1)
    release.set()
    problems = server._replace(why)
    assert problems and "runs in this rank's own process: it cannot be killed" in problems[0]
    assert server.engine is engine and server.restarted == 0
