"""megarlhf.config.redact: secrets out of the config copies that leave the process, nothing else touched."""
from pathlib import Path

import pytest

from megarlhf.config import RunConfig, load_config, to_dict
from megarlhf.config.redact import REDACTED, is_secret_key, redact, redact_text

RECIPES = sorted(p for p in (Path(__file__).parents[2] / "examples" / "recipes").glob("*.yaml")
                 if p.name != "layouts.yaml")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_the_shipped_recipes_have_nothing_to_redact(recipe):
    try:
        config = to_dict(load_config(RunConfig, recipe, ["model.path=/models/m"]))
    except Exception:  # a recipe meant for another command's data (e.g. SFT without rewards): its raw YAML
        import yaml

        config = yaml.safe_load(recipe.read_text())
    assert redact(config) == config


@pytest.mark.parametrize("key", ["password", "api_key", "hf_token", "OPENAI_API_KEY", "secret", "judge-token",
                                 "aws_secret_key", "credentials", "access_key", "auth"])
def test_secret_like_keys(key):
    assert is_secret_key(key)
    assert redact({"kwargs": {key: "v", "nested": [{key: 3}]}}) == {
        "kwargs": {key: REDACTED, "nested": [{key: REDACTED}]}}


@pytest.mark.parametrize("key", ["max_new_tokens", "pad_token_id", "tokenizer", "token_budget", "keep_last",
                                 "secret_santa_size", "author", "key"])
def test_ordinary_keys_stay(key):
    assert not is_secret_key(key) and redact({key: "v"}) == {key: "v"}


@pytest.mark.parametrize("text, expected", [
    ("https://bob:hunter2@mlflow.example.com:5000/", f"https://bob:{REDACTED}@mlflow.example.com:5000/"),
    ("postgresql://u:p%40ss@db/mlflow", f"postgresql://u:{REDACTED}@db/mlflow"),
    ("http://h/x?token=abc&run=1", f"http://h/x?token={REDACTED}&run=1"),
    ("http://h/x?a=1&api_key=k1", f"http://h/x?a=1&api_key={REDACTED}"),
    ("https://user@host/path", "https://user@host/path"),  # no password
    ("databricks", "databricks"),
    ("file:/abs/mlruns", "file:/abs/mlruns"),
])
def test_credentials_in_uris(text, expected):
    assert redact_text(text) == expected
