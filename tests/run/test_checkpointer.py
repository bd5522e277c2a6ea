"""Run-state checkpoints (megarlhf/run/checkpointer.py) and the training-state extension of
megarlhf/checkpoint/distributed.py.

Reference for resume equivalence: the same run never interrupted. 4 RL steps (actor_update +
critic_update, 2 optimizer steps each, fp32, warmup + cosine lr, weight decay, clipping) vs 2 steps,
save, rebuild of actor and critic from the HF directories, RNGs re-seeded elsewhere, resume, 2 steps:
metrics, parameters, Adam's exp_avg / exp_avg_sq / step, lr and scheduler step count must be
bit-identical — at DP=2 and in one process with the distributed optimizer, and once with the plain one.
Disabling the priming, the 'step' KeyError or the step-unsharing workaround makes these tests fail
(checked by hand: AssertionError at load, KeyError at load, and params / Adam state / metrics off).
Resharding: the DP=2 checkpoint resumed at DP=1 ends within rounding of the DP=2 run, while dropping
Adam's state at the same point lands far away. Atomicity: a process killed while writing step_2's
marker leaves step_1 loadable.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarlhf.testing.launch import read_rank_results, run_torchrun

WORKER = Path(__file__).with_name("_worker_run_checkpoint.py")
STATE_KEYS = [f"{role}/{key}" for role in ("actor", "critic")
              for key in ("params", "exp_avg", "exp_avg_sq", "step", "lr", "scheduler_steps")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """(causal LM dir, ...ForSequenceClassification dir with the same body and a random score head)."""
    from transformers import AutoModelForSequenceClassification

    from model_providers.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("run_ckpt_models")
    make_tiny_model("llama", root / "llama", seed=0)
    rm = AutoModelForSequenceClassification.from_pretrained(root / "llama", num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        rm.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(100))
    rm.save_pretrained(root / "llama-rm")
    return str(root / "llama"), str(root / "llama-rm")


@pytest.fixture(scope="module")
def kill_started(tiny, tmp_path_factory):
    """Starts a process that saves step_1 and dies (os._exit) half-way through writing step_2's marker; it
    runs while the DP=2 ranks work (launch costs dominate this module)."""
    work = tmp_path_factory.mktemp("run_ckpt_kill")
    log = open(work / "kill.log", "w")
    # Own session: the dead save leaves Megatron's multiprocessing Manager orphaned; its group is ended below.
    proc = subprocess.Popen([sys.executable, str(WORKER), "kill", str(work / "results"), *tiny, str(work)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    yield work, proc
    log.close()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def dp2(tiny, kill_started, tmp_path_factory) -> tuple[Path, list[dict]]:
    work = tmp_path_factory.mktemp("run_ckpt_dp2")
    run_torchrun(WORKER, 2, ["dp2", str(work / "results"), *tiny, str(work)], timeout_s=600)
    return work, read_rank_results(work / "results", 2)


@pytest.fixture(scope="module")
def killed(kill_started) -> dict:
    """What the dead process left, recorded before the single-rank worker resumes from it."""
    work, proc = kill_started
    returncode = proc.wait(timeout=600)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    names = sorted(p.name for p in (work / "checkpoints").iterdir())
    partial = work / "checkpoints" / names[-1]
    return {"work": work, "returncode": returncode, "log": (work / "kill.log").read_text()[-3000:], "names": names,
            "partial_files": sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file())}


@pytest.fixture(scope="module")
def single(tiny, dp2, killed, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("run_ckpt_single")
    run_torchrun(WORKER, 1, ["single", str(work / "results"), *tiny, str(work), str(dp2[0]), str(killed["work"])],
                 timeout_s=600)
    return read_rank_results(work / "results", 1)[0]


def check_equivalence(r: dict, label: str) -> None:
    assert r["fresh_differs"]  # the rebuilt model really started elsewhere
    assert r["extra_state"] == {"step": 2, "label": label}
    assert r["equal_at_resume"] == {key: True for key in STATE_KEYS}, r["equal_at_resume"]
    assert r["equal_at_end"] == {key: True for key in STATE_KEYS}, r["equal_at_end"]
    assert len(r["reference"]) == 4 and r["resumed"] == r["reference"]  # every metric, every RNG draw
    assert r["adam_steps"]["saved"] == 4.0 and set(r["adam_steps"]["final"]) == {8.0}
    assert r["lr"]["saved"][0] != r["lr"]["final"][0]  # the schedule moved across the resume
    for step in r["reference"]:
        assert step["actor/skipped_steps"] == 0 and step["critic/skipped_steps"] == 0


def test_resume_is_bit_identical_at_dp2(dp2):
    _, ranks = dp2
    for rank in ranks:
        check_equivalence(rank["distributed"], "dp2")
    # per-rank RNG streams: the ranks drew different numbers and each got its own back
    assert ranks[0]["distributed"]["reference"][3]["rng"] != ranks[1]["distributed"]["reference"][3]["rng"]
    last = [rank["distributed"]["reference"][3] for rank in ranks]
    assert last[0]["actor/loss"] == last[1]["actor/loss"]  # while the metrics are global


@pytest.mark.parametrize("layout", ["dp2", "plain"])
def test_an_async_save_holds_the_state_at_save_time_and_appears_only_once_written(dp2, single, layout):
    """checkpoint.async_save (DP=2 with the distributed optimizer; one rank with the plain one, whose Adam
    state is not cloned when staged): steps 3 and 4 ran while step_2 was written in the background, yet the
    resume found step 2's exact state; the checkpoint was published only after the write, and the steps
    taken meanwhile are the uninterrupted run's."""
    for r in [rank["distributed"] for rank in dp2[1]] if layout == "dp2" else [single["plain"]]:
        check_equivalence(r, "dp2" if layout == "dp2" else "plain")
        assert r["in_flight"]["published_at_save"] is False and r["in_flight"]["published_at_close"] is True
        assert r["in_flight"]["pending_after_steps"] == ["step_2"]  # the write was held until after step 4
        assert r["in_flight"]["listing"] == ["step_2"]  # no temporary directory is left behind
        assert r["in_flight"]["steps"] == r["reference"][2:]


@pytest.mark.parametrize("optimizer", ["distributed", "fully_reshardable", "plain"])
def test_resume_is_bit_identical_in_one_process(single, optimizer):
    """The distributed optimizer in both checkpoint.optimizer_format formats (dp_reshardable by default), and
    the plain one."""
    from megarlhf.checkpoint.distributed import checkpoint_metadata

    check_equivalence(single[optimizer], optimizer)
    if optimizer != "plain":  # the marker says which format the state was saved in (loading reads it so)
        fmt = "dp_reshardable" if optimizer == "distributed" else "fully_reshardable"
        saved = checkpoint_metadata(single[optimizer]["path"])["optimizer"]
        assert saved == {"kind": "distributed", "fresh": False, "format": fmt}


def test_dp2_checkpoint_resumes_at_dp1(single, dp2):
    r, dp2_ranks = single["reshard"], dp2[1]
    assert r["extra_state"] == {"step": 2, "label": "dp2"}
    assert r["adam_step_at_resume"] == 4.0 and r["scheduler_steps_at_resume"] == 4
    assert r["lr_at_resume"] == dp2_ranks[0]["distributed"]["lr"]["saved"]
    assert len(r["warnings"]) == 1 and "saved by 2 ranks" in r["warnings"][0] and "re-seeded" in r["warnings"][0]
    assert "per-rank state of 2 ranks; this job has 1" in r["rank_state_error"]
    reference = dp2_ranks[0]["distributed"]["reference"]
    for ours, theirs in zip(r["metrics"], reference[2:]):
        for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/value_loss",
                    "critic/grad_norm", "actor/lr", "critic/lr"):
            assert abs(ours[key] - theirs[key]) <= 1e-5 * max(abs(theirs[key]), 1e-3), (key, ours[key], theirs[key])
    # DP=1 vs DP=2 differ by rounding only; a resume that lost Adam's state is ~100x further away.
    assert r["final_param_max_diff"] <= max(3 * r["dp1_vs_dp2_max_diff"], 1e-5), r
    assert r["lost_optimizer_max_diff"] > 1e-4 and r["lost_optimizer_max_diff"] > 20 * r["final_param_max_diff"], r


def test_never_stepped_optimizer_round_trip(single):
    r = single["selection"]
    assert r["fresh_extra"] == {"step": 0} and r["fresh_state_empty"]
    assert r["fresh_then_step_equal"] == {f"actor/{k}": True for k in
                                          ("params", "exp_avg", "exp_avg_sq", "step", "lr", "scheduler_steps")}


def test_keep_last_and_resume_selection(single):
    r = single["selection"]
    assert r["resume_without_checkpoints"] is None
    assert r["listing_after_1"] == ["step_0", "step_1"]
    assert r["listing_after_2"] == ["step_1", "step_2"]
    assert r["listing_after_3"] == ["step_2", "step_3"]
    assert r["auto_extra"] == {"step": 3}  # not the unfinished step_7 nor the partial step_9.tmp-*
    assert r["none_extra"] is None
    errors = r["errors"]
    assert "incomplete checkpoint at" in errors["incomplete"] and "step_7" in errors["incomplete"]
    assert "checkpoint.resume=" in errors["missing"] and "does not exist" in errors["missing"]
    assert "holds the companion models ['critic'], this run has []" in errors["with_critic"]
    assert "holds the companion models [], this run has ['critic']" in errors["critic_missing"]


def test_kill_during_save_leaves_previous_checkpoint(killed, single):
    assert killed["returncode"] == 17, killed["log"]
    # the complete step_1 and a partial step_2 under a temporary name (Megatron's files, RNG, half a marker)
    names = killed["names"]
    assert names[0] == "step_1" and len(names) == 2 and names[1].startswith("step_2.tmp-"), names
    assert {"metadata.json", "rank_state/rank0.pt", "megarlhf_checkpoint.json"} <= set(killed["partial_files"])
    r = single["after_kill"]
    assert r["extra_state"] == {"step": 1} and r["params_equal"]  # resume auto: step_1, bit-identical weights
    assert r["listing_after_save"] == ["step_1", "step_2"]  # the partial save is gone after the next save


def test_a_publish_that_fails_on_rank_0_raises_on_every_rank(dp2):
    """DP=2, rank 0's marker write fails: rank 0 raises the OSError, rank 1 a CheckpointError with it; nothing
    is published. Before, rank 1 waited at a barrier until rank 0's process was gone, then raised gloo's
    "Connection closed by peer" (seen failing so; under NCCL it waits for the collective timeout)."""
    ranks = dp2[1]
    assert ranks[0]["publish_failure"]["error"] == "OSError: [Errno 28] No space left on device"
    other = ranks[1]["publish_failure"]["error"]
    assert other.startswith("CheckpointError: rank 0 could not publish checkpoint") and "step_1" in other, other
    assert "No space left on device" in other
    for rank in ranks:
        listing = rank["publish_failure"]["listing"]
        assert len(listing) == 1 and listing[0].startswith("step_1.tmp-"), listing


def test_a_failed_background_write_is_reported_and_not_published(single):
    r = single["async_failure"]
    assert r["listing_in_flight"][0] == "step_1" and r["listing_in_flight"][1].startswith("step_2.tmp-")
    assert "CheckpointError: the background save of checkpoint" in r["error"] and "step_2" in r["error"], r["error"]
    assert r["listing_after"] == ["step_1"] and r["latest"] == "step_1"


def test_should_save_and_constructor_errors(tmp_path):
    from megarlhf.config.train import CheckpointConfig, LoggingConfig
    from megarlhf.config.model import ModelConfig
    from megarlhf.config.schema import RunConfig
    from megarlhf.config.data import DataConfig
    from megarlhf.run.checkpointer import RunCheckpointer
    from megarlhf.learner.models import TrainModel

    def config(**checkpoint):
        return RunConfig(model=ModelConfig(path="unused"), data=DataConfig(train_path="unused.jsonl"),
                         checkpoint=CheckpointConfig(**checkpoint), logging=LoggingConfig(run_dir=str(tmp_path)))

    actor = TrainModel("actor", torch.nn.Linear(1, 1), None, None, optimizer=object())
    every3 = RunCheckpointer(config(every=3), {"actor": actor})
    assert [s for s in range(1, 11) if every3.should_save(s, 10)] == [3, 6, 9, 10]
    at_end = RunCheckpointer(config(every=0), {"actor": actor})
    assert [s for s in range(1, 11) if at_end.should_save(s, 10)] == [10]
    assert every3.directory == tmp_path / "checkpoints"
    assert RunCheckpointer(config(dir=str(tmp_path / "x")), {"actor": actor}).directory == tmp_path / "x"
    with pytest.raises(ValueError, match="must include 'actor'"):
        RunCheckpointer(config(), {"critic": actor})
    with pytest.raises(ValueError, match=r"\['reference'\] have no optimizer"):
        RunCheckpointer(config(), {"actor": actor, "reference": TrainModel("reference", actor.model, None, None)})
