"""The generic dataclass loader on a small schema of its own: types, unions, Literal, lists, nested
dataclasses, overrides and every error path."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from megarlhf.config import ConfigError, apply_override, from_dict, load_config, parse_override, save_config


@dataclass
class Leaf:
    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.weight < 0:
            raise ValueError(f"Leaf.weight must be >= 0, got {self.weight}")


@dataclass
class Inner:
    mode: Literal["fast", "slow"] = "fast"
    limit: int | None = None
    ratio: float = 0.5
    flag: bool = False


@dataclass
class Root:
    path: str
    inner: Inner = field(default_factory=Inner)
    leaves: list[Leaf] = field(default_factory=lambda: [Leaf("a")])
    maybe: Inner | None = None
    ks: list[int] = field(default_factory=lambda: [1])


def load(*overrides, path=None):
    return load_config(Root, path, ["path=/x", *overrides])


def test_defaults_live_in_the_dataclasses():
    assert load() == Root(path="/x")


def test_overrides_parse_yaml_and_convert_types():
    config = load("inner.limit=7", "inner.ratio=1", "inner.mode=slow", "inner.flag=true", "ks=[2, 3]",
                  "leaves=[{name: b, weight: 2, kwargs: {k: [1, 2]}}]", "maybe.limit=3", "inner.ratio=1e-6")
    assert config.inner == Inner(mode="slow", limit=7, ratio=1e-6, flag=True)
    assert type(config.inner.ratio) is float
    assert config.leaves == [Leaf("b", 2.0, {"k": [1, 2]})] and type(config.leaves[0].weight) is float
    assert config.maybe == Inner(limit=3) and config.ks == [2, 3]
    assert load("inner.limit=null").inner.limit is None


def test_yaml_file_then_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("path: /data\ninner:\n  limit: 4\nleaves:\n  - name: a\n  - name: b\n    weight: 3\n")
    config = load_config(Root, recipe, ["inner.limit=5", "leaves.1.weight=0.25"])
    assert config.path == "/data" and config.inner.limit == 5
    assert [leaf.weight for leaf in config.leaves] == [1.0, 0.25]


@pytest.mark.parametrize("override, message", [
    ("inner.limt=3", r"unknown config key 'inner\.limt' \(did you mean 'inner\.limit'\?\); "
                     r"allowed keys under inner: mode, limit, ratio, flag"),
    ("innr.limit=3", r"unknown config key 'innr' \(did you mean 'inner'\?\)"),
    ("leaves=[{name: a, wieght: 2}]", r"unknown config key 'leaves\.0\.wieght' \(did you mean 'leaves\.0\.weight'"),
    ("inner.mode=medium", r"inner\.mode: 'medium' is not allowed; allowed values: 'fast', 'slow'"),
    ("inner.limit=2.5", r"inner\.limit: expected int, got 2\.5 \(float\) \(or null\)"),
    ("inner.limit=true", r"inner\.limit: expected int, got True"),
    ("inner.ratio=abc", r"inner\.ratio: expected float, got 'abc'"),
    ("inner.flag=1", r"inner\.flag: expected bool, got 1"),
    ("ks=[1, x]", r"ks\.1: expected int, got 'x'"),
    ("ks=3", r"ks: expected a list, got 3"),
    ("inner=3", r"inner: expected a mapping of Inner fields, got 3"),
    ("leaves=[{name: a, weight: -1}]", r"leaves\.0\.weight must be >= 0, got -1\.0"),
    ("leaves=[{weight: 1}]", r"missing required config key\(s\): leaves\.0\.name"),
    ("path=null", r"path: expected str, got None"),
    # a wrong key inside an optional section is about the key, not about the section being null
    ("maybe.limt=3", r"allowed keys under maybe: mode, limit, ratio, flag$"),
    ("maybe.limit=2.5", r"maybe\.limit: expected int, got 2\.5 \(float\) \(or null\)$"),
])
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load(override)


def test_missing_required_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"missing required config key\(s\): path"):
        load_config(Root, None, [])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Root, tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Root, tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("path: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Root, tmp_path / "bad.yaml")


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        parse_override("inner.limit")
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        parse_override("inner..limit=3")
    with pytest.raises(ConfigError, match="ks is a list of 1 entries and '5' is not an index"):
        apply_override({"ks": [1]}, ["ks", "5"], 2)
    with pytest.raises(ConfigError, match="leaves is not a list in the recipe"):
        load("leaves.0.weight=2")
    assert parse_override("a.b= [1, {c: d}]") == (["a", "b"], [1, {"c": "d"}])


def test_round_trip(tmp_path):
    config = load("inner.mode=slow", "inner.ratio=3e-7", "leaves=[{name: z, kwargs: {s: 'x y', n: null}}]",
                  "maybe={limit: 2}")
    saved = save_config(config, tmp_path / "run" / "config.yaml")
    again = load_config(Root, saved)
    assert again == config
    assert save_config(again, tmp_path / "again.yaml").read_text() == saved.read_text()
    assert from_dict(Root, {"path": "/x"}) == Root(path="/x")


@pytest.mark.parametrize("override, replacement", [
    ("logging.tensorboard=true", "use logging.backends: [tensorboard]"),
    ("rollout.weight_sync_bucket_mb=64", "use rollout.weight_sync.bucket_mb"),
    ("rollout.weight_sync.probe_longest=false", "use rollout.weight_sync.probe_max_length"),
])
def test_a_removed_key_is_refused_naming_its_replacement(override, replacement):
    from megarlhf.config import RunConfig, load_config

    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^config key '{key}' was removed; {re.escape(replacement)}"):
        load_config(RunConfig, None, ["model.path=m", override])
