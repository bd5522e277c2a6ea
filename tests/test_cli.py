"""The ``megarlhf`` command line (megarlhf/cli.py): registered sub-commands, argument and path errors.

The conversion round trip through the real command lives in tests/tools/test_convert_checkpoint.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megarlhf import cli


def test_every_registered_command_has_a_subparser(capsys):
    parser = cli.build_parser()
    assert "convert" in cli.COMMANDS.names()
    for name in cli.COMMANDS.names():
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([name, "--help"])
        assert exit_info.value.code == 0 and f"usage: megarlhf {name}" in capsys.readouterr().out
    args = parser.parse_args(["convert", "hf-to-megatron", "--hf", "a", "--out", "b", "--tp", "2"])
    assert (args.command, args.direction, args.hf, args.out, args.tp, args.pp, args.dtype, args.overwrite) == (
        "convert", "hf-to-megatron", "a", "b", 2, 1, None, False)
    args = parser.parse_args(["convert", "megatron-to-hf", "--ckpt", "c", "--out", "d", "--dtype", "bfloat16"])
    assert (args.ckpt, args.hf_config, args.dtype, args.max_shard_mib) == ("c", None, "bfloat16", None)
    args = parser.parse_args(["convert", "megatron-to-hf", "--ckpt", "c", "--out", "d", "--max-shard-mib", "256"])
    assert args.max_shard_mib == 256


@pytest.mark.parametrize("argv", [[], ["convert"], ["train"], ["convert", "hf-to-megatron", "--hf", "a"],
                                  ["convert", "megatron-to-hf", "--ckpt", "c", "--out", "d", "--tp", "two"],
                                  ["convert", "megatron-to-hf", "--ckpt", "c", "--out", "d", "--dtype", "fp8"],
                                  ["convert", "hf-to-megatron", "--hf", "a", "--out", "b", "--max-shard-mib", "9"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "usage: megarlhf" in capsys.readouterr().err


def test_missing_hf_directory_is_one_clear_line(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(missing), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"megarlhf convert: error: HF model directory {missing} does not exist"


def test_hf_directory_without_config(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    assert "has no config.json" in capsys.readouterr().err


def test_existing_output_needs_overwrite(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "megarlhf_checkpoint.json").write_text("{}")  # an earlier conversion's
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert cli.main(["convert", "hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mine"),
                         *extra]) == 1
        assert "is not empty and was not written by megarlhf" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_missing_and_incomplete_checkpoints(tmp_path, capsys):
    missing = tmp_path / "ckpt"
    assert cli.main(["convert", "megatron-to-hf", "--ckpt", str(missing), "--out", str(tmp_path / "o")]) == 1
    assert f"no checkpoint at {missing}" in capsys.readouterr().err
    missing.mkdir()
    (missing / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert cli.main(["convert", "megatron-to-hf", "--ckpt", str(missing), "--out", str(tmp_path / "o")]) == 1
    assert f"incomplete checkpoint at {missing}" in capsys.readouterr().err


def test_non_positive_parallel_size(tmp_path, capsys):
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(tmp_path), "--out", str(tmp_path / "o"),
                     "--tp", "0"]) == 1
    assert "tensor_model_parallel_size must be a positive integer, got 0" in capsys.readouterr().err


def test_options_may_follow_the_recipe_and_overrides():
    args = cli.parse_args(["plan", "recipe.yaml", "--gpus", "8", "optim.lr=1e-6", "--json", "seed=3"])
    assert (args.command, args.recipe, args.gpus, args.json) == ("plan", "recipe.yaml", 8, True)
    assert args.overrides == ["optim.lr=1e-6", "seed=3"]
    same = cli.parse_args(["plan", "--gpus", "8", "--json", "recipe.yaml", "optim.lr=1e-6", "seed=3"])
    assert vars(same) == vars(args)
    train = cli.parse_args(["train", "r.yaml", "a.b=1", "c=2"])
    assert (train.command, train.recipe, train.overrides) == ("train", "r.yaml", ["a.b=1", "c=2"])
    export = cli.parse_args(["export", "r.yaml", "--out", "hf", "x=1"])
    assert (export.out, export.overrides) == ("hf", ["x=1"])


def test_plan_with_flags_after_the_recipe_runs(capsys):
    from pathlib import Path

    recipe = str(Path(__file__).parents[1] / "examples" / "recipes" / "qwen2.5-7b_grpo.yaml")
    plans = []
    for argv in (["plan", recipe, "--json", "--gpus", "8"], ["plan", "--gpus", "8", "--json", recipe],
                 ["plan", recipe, "--json"]):
        assert cli.main(argv) in (0, 1)  # 1: the plan does not fit
        plans.append(json.loads(capsys.readouterr().out))
    assert plans[0] == plans[1]
    # 8 ranks shard the distributed optimizer over more data-parallel ranks than the default layout's
    assert plans[0]["stages"][0]["actor_optimizer"] < plans[2]["stages"][0]["actor_optimizer"]


def _command_raising(monkeypatch, error: BaseException) -> None:
    real = cli.COMMANDS.get

    def run(args):
        raise error

    monkeypatch.setattr(cli.COMMANDS, "get", lambda name: dataclasses.replace(real(name), run=run))


def test_user_errors_are_one_line_naming_the_file(monkeypatch, capsys):
    from megarlhf.core.errors import ConfigError, DataError
    from megarlhf.config.parallel import LayoutError, ParallelConfig

    try:
        ParallelConfig(tensor_model_parallel_size=3).validate(4)
    except LayoutError as err:
        layout = err
    for error in (DataError("prompts.jsonl:7: malformed JSON line (Expecting value at column 1)"),
                  ConfigError("optim.lr: 'fast' is not a valid float"), layout,
                  FileNotFoundError(2, "No such file or directory", "runs/x/config.yaml")):
        _command_raising(monkeypatch, error)
        assert cli.main(["plan", "recipe.yaml"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("megarlhf plan: error: "), err
        assert str(error) in err


def test_internal_errors_are_one_line_naming_their_traceback_file(monkeypatch, capsys, tmp_path):
    """An error that is not the user's (megarlhf's own check failing) is one line that says so and names the
    file holding its traceback; with --verbose it propagates with its traceback."""
    from megarlhf.core import console

    monkeypatch.setattr(console, "_log_dir", tmp_path / "logs")
    for error in (ValueError("run_schedule: no micro-batches"), KeyError("actor/loss"),
                  RuntimeError("engine died\nsecond line")):
        _command_raising(monkeypatch, error)
        assert cli.main(["plan", "recipe.yaml"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"megarlhf plan: error: {type(error).__name__}: "), err
        assert "an error inside megarlhf: traceback in " in err and "--verbose" in err
        if "second line" in str(error):  # a verdict lists its problems below its first line: kept (were dropped)
            assert "engine died second line" in err
        path = err.split("traceback in ")[1].split(",")[0]
        assert f"raise error" in open(path).read() and path.startswith(str(tmp_path / "logs"))
        with pytest.raises(type(error)) as raised:
            cli.main(["plan", "recipe.yaml", "--verbose"])
        assert raised.value is error and raised.traceback


def test_a_recipe_whose_model_matches_nothing_is_one_line(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model:\n  path: {tmp_path / 'nowhere'}\ndata:\n  train_path: train.jsonl\n")
    assert cli.main(["plan", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no config.json and its name matches no preset" in err, err
