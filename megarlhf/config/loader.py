"""One loader for any tree of dataclasses: YAML recipe + ``key.sub=value`` overrides -> typed config.

The dataclasses are the schema and hold every default; this module only fills them:

1. the YAML file becomes a nested dict (missing keys keep the dataclass defaults);
2. each override ``a.b.c=value`` sets that path in the dict (``value`` is parsed as YAML, so ``3`` is an
   int, ``[1, 2]`` a list, ``null`` None; a numeric part indexes into a list: ``reward.functions.0.weight=2``);
3. :func:`from_dict` builds the dataclasses top-down, checking every value against its field's
   annotation (``bool``, ``int``, ``float``, ``str``, ``Any``, ``Optional``/unions, ``Literal``,
   ``list[...]``, ``dict[str, ...]``, nested dataclasses) and running each dataclass's own
   ``__post_init__`` validation (ranges, registry names).

Every error is a :class:`ConfigError` that names the full key path: unknown keys come with the
closest known key (difflib) and the allowed keys; Literal fields list their allowed values; a key a
dataclass lists in its ``refused_keys`` class attribute (a setting megarlhf deliberately does not offer)
is reported with the dataclass's reason.
:func:`save_config` writes the resolved config as YAML; loading that file gives an equal config.

An int is accepted where a float is expected, and so is a string that parses as a float, because
PyYAML reads ``1e-6`` (no dot) as a string. OmegaConf, Hydra and dacite keep a second copy of the defaults,
lack Literal checks with key paths, or bring a framework.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar, Union

import yaml

from megarlhf.core.errors import ConfigError  # re-exported as megarlhf.config.ConfigError
from megarlhf.core.outputs import apply_umask

T = TypeVar("T")


def _where(path: str) -> str:
    return path or "<root>"


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _convert(value: Any, annotation: Any, path: str) -> Any:
    """``value`` checked (and built, for dataclasses) against ``annotation``; raises ConfigError."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arm, path)
            except ConfigError as exc:
                errors.append(str(exc))
        if len(errors) == 1:  # "or null" only where the error is about this value, not a key inside it
            about_this = errors[0].startswith(f"{_where(path)}:")
            raise ConfigError(errors[0] + (" (or null)" if type(None) in args and about_this else ""))
        raise ConfigError(f"{_where(path)}: {value!r} is not a valid {_type_name(annotation)}")
    if origin is Literal:
        if value in args and any(type(value) is type(a) for a in args if a == value):
            return value
        allowed = ", ".join(repr(a) for a in args)
        raise ConfigError(f"{_where(path)}: {value!r} is not allowed; allowed values: {allowed}")
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, path)
    if origin in (list, Sequence, typing.List):
        if not isinstance(value, list):
            raise ConfigError(f"{_where(path)}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_convert(v, item, f"{path}.{i}") for i, v in enumerate(value)]
    if origin in (dict, typing.Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(path)}: expected a mapping, got {value!r}")
        key_type, item = args if args else (Any, Any)
        return {_convert(k, key_type, f"{path}.{k}"): _convert(v, item, f"{path}.{k}") for k, v in value.items()}
    return _convert_scalar(value, annotation, path)


def _convert_scalar(value: Any, annotation: Any, path: str) -> Any:
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:
        raise ConfigError(f"{_where(path)}: the config loader does not support fields of type "
                          f"{_type_name(annotation)}")
    raise ConfigError(f"{_where(path)}: expected {annotation.__name__}, got {value!r} ({type(value).__name__})")


# Keys earlier versions of megarlhf accepted, and what replaced them: a recipe written for one of those versions
# is refused with the replacement named.
REMOVED_KEYS = {
    "logging.tensorboard": "logging.backends: [tensorboard]",
    "rollout.weight_sync_bucket_mb": "rollout.weight_sync.bucket_mb",
    "rollout.weight_sync.probe_longest": "rollout.weight_sync.probe_max_length (0: no long probe sequence)",
    "parallel.ref": "nothing: every model of a run shares the parallel.* layout",
    "rollout.gpu_memory_utilization": "rollout.kv_cache_mb (the engine's KV cache in MiB, on CPU and GPU)",
    "train.step0_logprob_tolerance": "gates.step0_max and gates.step0_mean (null: calibrated)",
    "algorithm.policy.clip_eps": "algorithm.policy.clip_eps_low and algorithm.policy.clip_eps_high",
}


def _unknown_key_error(key: str, known: list[str], path: str) -> ConfigError:
    full = f"{path}.{key}" if path else key
    if full in REMOVED_KEYS:
        return ConfigError(f"config key '{full}' was removed; use {REMOVED_KEYS[full]}")
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{path + '.' if path else ''}{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{full}'{hint}; allowed keys under {_where(path)}: {', '.join(known)}")


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Builds dataclass ``cls`` from a nested dict; keys it lacks keep their defaults."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{_where(path)}: expected a mapping of {cls.__name__} fields, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    refused = getattr(cls, "refused_keys", {})
    for key, value in data.items():
        if key in refused:
            raise ConfigError(f"{path + '.' if path else ''}{key}: {refused[key]}")
        if key not in fields:
            raise _unknown_key_error(str(key), list(fields), path)
        kwargs[key] = _convert(value, hints[key], f"{path}.{key}" if path else key)
    missing = [name for name, f in fields.items() if name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        names = ", ".join(f"{path}.{m}" if path else m for m in missing)
        raise ConfigError(f"missing required config key(s): {names}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # the dataclass's own validation (ranges, registry names)
        raise ConfigError(_validation_message(cls, path, str(exc))) from None


def _validation_message(cls: type, path: str, message: str) -> str:
    """A dataclass's own error, with ``ClassName.field`` rewritten to the full key path."""
    message = message.replace(f"{cls.__name__}.", f"{path}." if path else "")
    if path and f"{path}." not in message:
        message = f"{path}: {message}"
    return message


def to_dict(config: Any) -> Any:
    """The plain-data form of a dataclass tree (what :func:`save_config` writes)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> (["a", "b"], 3); the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML: {exc}") from None
    return key.strip().split("."), value


def apply_override(tree: dict, keys: list[str], value: Any) -> None:
    """Sets ``tree[k0][k1]... = value``, creating mappings on the way (a digit key indexes a list)."""
    node: Any = tree
    for depth, key in enumerate(keys):
        last = depth == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"override {'.'.join(keys)}: {'.'.join(keys[:depth])} is a list of "
                                  f"{len(node)} entries and {key!r} is not an index of it; set the whole list")
            key = int(key)
        elif not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(keys)}: {'.'.join(keys[:depth])} is {node!r}, not a mapping")
        elif key.isdigit() and key not in node:
            raise ConfigError(f"override {'.'.join(keys)}: {'.'.join(keys[:depth])} is not a list in the "
                              f"recipe, so entry {key} cannot be set; set the whole list instead")
        if last:
            node[key] = value
        else:
            if isinstance(node, dict) and not isinstance(node.get(key), (dict, list)):
                node[key] = {}
            node = node[key]


def load_config(cls: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """``cls`` filled from the YAML file at ``path`` (optional) and then the ``key.sub=value`` overrides."""
    tree: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(tree, keys, value)
    return from_dict(cls, tree)


def save_config(config: Any, path: str | os.PathLike) -> Path:
    """Writes the resolved config as YAML (:func:`save_yaml`)."""
    return save_yaml(to_dict(config), path)


def save_yaml(tree: Any, path: str | os.PathLike) -> Path:
    """Writes plain data as YAML, atomically (a partial file is never left behind), with the umask's modes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(tree, sort_keys=False, default_flow_style=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    apply_umask(Path(tmp))  # mkstemp makes it 0600
    os.replace(tmp, path)
    return path
