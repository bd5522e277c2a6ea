"""The start-up timeline (megarlhf/core/startup.py): phases between marks, reported once, a second run
counting from its own start."""
import time

import pytest

from megarlhf.core import startup


@pytest.fixture(autouse=True)
def fresh_timeline(monkeypatch):
    monkeypatch.setattr(startup, "_marks", [])
    monkeypatch.setattr(startup, "_reported", False)
    monkeypatch.setattr(startup, "_origin", None)


def test_phases_are_the_gaps_between_marks_from_the_process_start(monkeypatch):
    monkeypatch.setattr(startup, "process_start", lambda: 100.0)
    clock = iter([103.0, 103.5, 110.0, 111.0])
    monkeypatch.setattr(startup.time, "time", lambda: next(clock))
    startup.begin()
    for name in ("imports", "actor", "engine", "actor"):
        startup.mark(name)
    assert startup.phases() == {"imports": 3.0, "actor": 0.5 + 1.0, "engine": 6.5}
    metrics = startup.report()
    assert metrics == {"time/startup_s": 11.0, "time/startup/imports_s": 3.0, "time/startup/actor_s": 1.5,
                       "time/startup/engine_s": 6.5}
    assert startup.describe(metrics) == "start-up 11.0 s: imports 3.0, actor 1.5, engine 6.5"


def test_reported_once_and_later_marks_ignored(monkeypatch):
    startup.begin()
    startup.mark("imports")
    assert "time/startup_s" in startup.report()
    startup.mark("a_later_step")
    assert startup.report() == {}
    assert list(startup.phases()) == ["imports"]


def test_a_second_run_in_the_process_counts_from_its_own_start(monkeypatch):
    monkeypatch.setattr(startup, "process_start", lambda: time.time() - 1000.0)
    startup.begin()
    startup.mark("imports")
    assert startup.report()["time/startup_s"] >= 1000.0
    startup.begin()
    startup.mark("imports")
    assert startup.report()["time/startup_s"] < 10.0


def test_the_log_line_names_every_phase(caplog):
    startup.begin()
    startup.mark("imports")
    startup.mark("engine")
    with caplog.at_level("INFO", logger="megarlhf.core.startup"):
        startup.report()
    assert len(caplog.records) == 1
    assert "imports" in caplog.text and "engine" in caplog.text and caplog.text.count("start-up") == 1
