"""Distributed checkpoints (megarlhf/checkpoint/distributed.py): resharding across TP/PP, atomic saves,
clear errors. The references are the HF safetensors file (bit-exact weights after every load), HF
transformers' logits, and the logits of the model that was saved."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megarlhf.checkpoint import CheckpointError, checkpoint_metadata, is_complete_checkpoint
from megarlhf.checkpoint.distributed import MCORE_ASYNC_NOTICE
from megarlhf.testing.launch import read_rank_results, run_torchrun

WORKER = Path(__file__).with_name("_worker_checkpoint.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from model_providers.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    make_tiny_model("qwen2", root / "qwen2", seed=3)  # tied embeddings, qkv biases, GQA
    make_tiny_model("llama", root / "llama", seed=4)
    return root


@pytest.mark.slow  # ~28 s of 2-rank saves and loads; resharded resumes also run in tests/loops
def test_checkpoint_saved_at_tp2_loads_at_tp1_and_pp2(tiny, tmp_path):
    proc = run_torchrun(WORKER, 2, ["reshard", str(tiny / "qwen2"), str(tmp_path)], timeout_s=600)
    assert MCORE_ASYNC_NOTICE not in proc.stdout + proc.stderr  # a synchronous save says nothing of async
    ranks = read_rank_results(tmp_path / "results", 2)
    marker = ranks[0]["marker"]
    assert marker["saved_with"] == {"world_size": 2, "tensor_model_parallel_size": 2,
                                    "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
                                    "expert_model_parallel_size": 1}
    assert marker["metadata"] == {"step": 7} and marker["has_extra_state"]
    assert marker["model"]["num_layers"] == 2 and marker["model"]["params_dtype"] == "float32"
    assert ranks[0]["saved_vs_hf"] < 1e-4  # the saved model is the HF model
    for layout in ("tp1", "pp2", "tp2_from_pp2"):
        for rank in ranks:
            r = rank[layout]
            assert not r["weights_equal_before_load"], layout  # the fresh model really was different
            assert r["weights_equal"], layout  # every tensor bit-identical to the HF file after loading
            assert r["extra_state"] == {"step": 7, "sampler": {"epoch": 1, "offset": 96}, "rng": [0, 1, 2, 3]}
            if r["last_stage"]:
                assert r["vs_saved"] < 1e-5, (layout, r["vs_saved"])
                assert r["vs_hf"] < 1e-4, (layout, r["vs_hf"])
    # TP=2 pads the vocab (384) to 512, TP=1 does not: the embedding was resharded across paddings.
    assert ranks[0]["tp1"]["padded_vocab"] == 384 and ranks[0]["tp2_from_pp2"]["padded_vocab"] == 512
    assert [r["pp2"]["last_stage"] for r in ranks] == [False, True]


def test_only_megatrons_async_notice_of_a_synchronous_save_is_dropped():
    """megatron-core 0.19's synchronous save logs that MCore *async* saving is deprecated; megarlhf drops
    that message once save_checkpoint has run, and nothing else of the logger's."""
    import logging

    import megarlhf.checkpoint.distributed as distributed
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    def passes(message: str) -> bool:
        logger = torch_strategy.logger
        return logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None))

    with pytest.raises(CheckpointError):  # installs the filter, then stops: no process group here
        distributed.save_checkpoint(None, "unused")
    assert not passes(f"{MCORE_ASYNC_NOTICE} and will be removed in the future releases. Please, use NVRx ...")
    assert passes("some other warning of Megatron's torch_dist strategy")


@pytest.mark.slow  # ~40 s on 2 cores: make test-slow
def test_interrupted_saves_leave_previous_checkpoint_loadable(tiny, tmp_path):
    # Own session: the killed save leaves Megatron's multiprocessing Manager orphaned; its group is ended below.
    log = tmp_path / "kill.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(WORKER), "kill", str(tiny / "qwen2"), str(tmp_path)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            returncode = proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert returncode == -signal.SIGKILL, log.read_text()[-3000:]
    ckpt = tmp_path / "ckpt"
    partial = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.tmp-")]
    assert len(partial) == 1 and (partial[0] / "metadata.json").is_file()  # Megatron had written its files
    with pytest.raises(CheckpointError, match="partial save"):
        checkpoint_metadata(partial[0])
    saved = json.loads((tmp_path / "hashes.json").read_text())
    now = {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted(ckpt.rglob("*")) if p.is_file()}
    assert now == saved  # the last good checkpoint is untouched, byte for byte
    assert is_complete_checkpoint(ckpt)

    atomic = subprocess.run([sys.executable, str(WORKER), "atomic", str(tiny / "qwen2"), str(tmp_path)],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert atomic.returncode == 0, atomic.stderr[-6000:]
    r = read_rank_results(tmp_path / "results", 1)[0]
    assert r["after_kill_step"] == 1 and r["after_kill_equal"]
    assert "simulated disk failure" in r["failed_save_raised"] and "unchanged" in r["failed_save_raised"]
    assert r["after_failure_step"] == 1 and r["after_failure_equal"]
    assert "ckpt" in r["siblings_after_failure"]
    assert any(n.startswith("ckpt.tmp-") for n in r["siblings_after_failure"])
    assert "rename it back" in r["between_renames_error"] and ".old-" in r["between_renames_error"]
    assert r["renamed_back_step"] == 1
    assert r["overwrite_step"] == 4 and r["overwrite_equal"]
    assert r["siblings_after_overwrite"] == ["ckpt"]  # leftovers of failed saves removed
    errors = r["errors"]
    assert "no checkpoint at" in errors["missing"] and str(tmp_path / "nope") in errors["missing"]
    assert "incomplete checkpoint at" in errors["incomplete"] and "megarlhf_checkpoint.json" in errors["incomplete"]
    assert "already exists" in errors["exists"] and "overwrite" in errors["exists"]
    assert "does not fit this model" in errors["wrong_model"] and "num_layers: checkpoint 2, model 4" in errors[
        "wrong_model"]
    assert "not JSON-serialisable" in errors["not_json"]


def test_a_synchronous_save_starts_no_helper_process(tiny, tmp_path):
    """Megatron's writer returns its results through a multiprocessing.Manager queue made on the first save: a
    spawned server on the save's critical path (3-4 s on CPU). A synchronous save needs no other process."""
    subprocess.run([sys.executable, str(WORKER), "helpers", str(tiny / "llama"), str(tmp_path)], check=True,
                   timeout=300)
    assert is_complete_checkpoint(tmp_path / "ckpt")
    assert json.loads((tmp_path / "helpers.json").read_text()) == {"children": [], "megatron_queue": "NoneType"}


def test_a_save_on_a_full_disk_fails_in_one_line_and_names_it(tiny, tmp_path):
    """Megatron's writer thread hits ENOSPC: torch raises a CheckpointException (a BaseException, which escaped
    the CLI's one-line errors) whose text names only the error's class. megarlhf's error names the checkpoint,
    the free space and what became of the partial save."""
    subprocess.run([sys.executable, str(WORKER), "full_disk", str(tiny / "llama"), str(tmp_path)], check=True,
                   timeout=300)
    result = json.loads((tmp_path / "full_disk.json").read_text())
    error = result["error"]
    assert error is not None and "\n" not in error
    assert f"writing checkpoint {tmp_path / 'ckpt'} failed" in error and "GiB free on its file system" in error
    assert "previous checkpoints are unchanged" in error and "may be deleted (the next save removes it)" in error
    assert result["siblings"] != ["ckpt"] and all(name.startswith("ckpt.tmp-") for name in result["siblings"])


def test_metadata_errors_without_distributed(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_metadata(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        checkpoint_metadata(tmp_path / "file")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "megarlhf_checkpoint.json").write_text("{truncated")
    with pytest.raises(CheckpointError, match="unreadable"):
        checkpoint_metadata(bad)
    (bad / "megarlhf_checkpoint.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a megarlhf checkpoint marker"):
        checkpoint_metadata(bad)
    (bad / "megarlhf_checkpoint.json").write_text(json.dumps({"format": "megarlhf.dist_checkpoint",
                                                              "format_version": 99}))
    with pytest.raises(CheckpointError, match="format version 99"):
        checkpoint_metadata(bad)
    assert not is_complete_checkpoint(bad)


def test_a_dp_reshardable_optimizer_state_is_refused_at_another_tensor_or_pipeline_layout(monkeypatch, tmp_path):
    """checkpoint.optimizer_format=dp_reshardable keeps Megatron's per-bucket layout, which only another
    data-parallel size reads: a resume at another TP or PP size is refused before Megatron reads anything,
    naming the setting; fully_reshardable state, and checkpoints saved before the choice (no format recorded:
    fully_reshardable then), load anywhere; another DP size is fine."""
    from megarlhf.checkpoint import fit
    from megarlhf.checkpoint.optimizer_state import SHARDING_METADATA

    monkeypatch.setattr(fit, "optimizer_kind", lambda optimizer: "distributed")  # this run's optimizer
    saved_with = {"world_size": 2, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                  "data_parallel_size": 1, "expert_model_parallel_size": 1}
    here = {**saved_with, "tensor_model_parallel_size": 1, "data_parallel_size": 2}
    monkeypatch.setattr(fit, "current_layout", lambda: here)

    def check(optimizer_marker):
        info = {"optimizer": optimizer_marker, "scheduler": True, "saved_with": saved_with}
        fit.check_parts_match(info, tmp_path / "step_4", object(), None, {})

    with pytest.raises(CheckpointError) as err:
        check({"kind": "distributed", "fresh": False, "format": "dp_reshardable"})
    message = str(err.value)
    assert message.startswith(f"checkpoint at {tmp_path / 'step_4'} does not fit this run: ")
    assert "checkpoint.optimizer_format=dp_reshardable at tensor_model_parallel_size=2 (this run: " \
           "tensor_model_parallel_size=1)" in message and "checkpoint.optimizer_format=fully_reshardable" in message
    check({"kind": "distributed", "fresh": False, "format": "fully_reshardable"})
    check({"kind": "distributed", "fresh": False})  # saved before the choice
    monkeypatch.setattr(fit, "current_layout", lambda: {**saved_with, "world_size": 4, "data_parallel_size": 2})
    check({"kind": "distributed", "fresh": False, "format": "dp_reshardable"})  # only DP changed
    assert set(SHARDING_METADATA) == {"dp_reshardable", "fully_reshardable"}
