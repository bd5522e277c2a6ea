"""megarlhf.core.console: a message is reported once per launch, by the first rank to meet it."""
import os
import time

from megarlhf.core import console


def test_once_per_launch_and_always_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(console.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    assert console.first_to_report("x") and console.first_to_report("x")  # a single process: every time
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert console.first_to_report("bad path") and not console.first_to_report("bad path")
    assert console.first_to_report("another message")
    markers = sorted((tmp_path / f"megarlhf-errors-{os.getuid()}").iterdir())
    assert len(markers) == 2 and all(m.name.startswith(f"{os.getppid()}-") for m in markers)
    old = time.time() - 2 * 86400
    os.utime(markers[0], (old, old))
    assert console.first_to_report("a third")
    assert markers[0].exists() is False and len(list(markers[1].parent.iterdir())) == 2


def test_a_marker_directory_of_someone_else_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setattr(console.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"megarlhf-errors-{os.getuid()}").symlink_to(tmp_path / "elsewhere")
    assert console.first_to_report("m") and console.first_to_report("m")


def test_a_file_in_the_markers_place_does_not_silence_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(console.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / f"megarlhf-errors-{os.getuid()}").write_text("")
    assert console.first_to_report("m") and console.first_to_report("m")
