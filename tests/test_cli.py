"""The ``megarlhf`` command line (megarlhf/cli.py): registered sub-commands, argument and path errors.

The conversion round trip through the real command lives in tests/tools/test_convert_checkpoint.py."""
from __future__ import annotations

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
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err


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
