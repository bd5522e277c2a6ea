"""megarlhf.run.context: the model path errors a user meets first."""
import pytest

from megarlhf.run.context import load_tokenizer


def test_a_hub_name_as_model_path_says_so_and_a_local_typo_does_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'Qwen/Qwen2.5-0.5B' is not an HF model directory .*hub name.*"
                                                r"megarlhf fetch"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")
    (tmp_path / "runs").mkdir()
    for local in ("runs/x/hf", "runs/x", str(tmp_path / "nowhere")):
        with pytest.raises(FileNotFoundError, match=r"\(no config.json there\)$"):
            load_tokenizer(local)
