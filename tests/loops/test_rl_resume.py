"""Resume equivalence of the RL driver: N steps uninterrupted vs killed after a checkpoint and resumed.

The interrupted run is a real torchrun job killed (SIGKILL to the launcher and every worker: torchrun
starts its workers in sessions of their own, so killing its process group alone leaves them running) as
soon as its first checkpoint is complete; ``checkpoint.resume: auto`` then continues to the same N steps. Every figure of
``metrics.jsonl`` must be bit-identical except wall-clock timings (``time/*`` and throughputs).
"""
import pytest

from megarlhf.records.metrics import read_metrics
from megarlhf.testing.launch import run_torchrun

from _rl_recipe import WORKER, kill_after_checkpoint, write_recipe

TIMING = ("time/", "weight_sync/bytes_per_s", "memory/")  # measured, not computed


def _recipe(tmp_path, assets, run_dir):
    return write_recipe(tmp_path / f"{run_dir.name}.yaml", assets, "gae", run_dir)


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


@pytest.mark.slow  # four 2-rank runs (~3-4 min on 2 cores): make test-slow
def test_killed_and_resumed_run_matches_uninterrupted(tmp_path, rl_assets):
    """The uninterrupted run saves synchronously; the interrupted one writes its checkpoints in the background
    (``checkpoint.async_save``: step_2 is published by a later step's poll) and is killed once step_2 is
    published. The resumed run must equal the uninterrupted one, so one comparison covers resuming and the
    equivalence of background and synchronous saves. Synchronous saves are resumed by the other drivers'
    resume tests (SFT, DPO/KTO, rounds, LoRA, MoE, off-policy).

    Then the finished run is resumed once more (as to export it again): it starts at its last step and its
    metrics.jsonl keeps the final evaluation, recomputed from the restored weights. Before, that resume cut
    the record (the recorder keeps the checkpoint's completed steps) and did not evaluate again."""
    # eval.every=4: an evaluation at step 0 (before the kill) and the final one at step 4 (after the
    # resume), so the resumed run's final evaluation is compared too (eval.every=0 turns both off).
    overrides = ["train.steps=4", "checkpoint.every=2", "eval.every=4", "optim.schedule=cosine",
                 "optim.warmup_steps=1"]
    full = tmp_path / "full"
    run_torchrun(WORKER, 2, [str(_recipe(tmp_path, rl_assets, full)), *overrides], timeout_s=900)

    cut = tmp_path / "cut"
    recipe = _recipe(tmp_path, rl_assets, cut)
    background = [*overrides, "checkpoint.async_save=true"]
    kill_after_checkpoint(WORKER, [str(recipe), *background], cut / "checkpoints" / "step_2",
                          cut / "checkpoints" / "step_4")
    run_torchrun(WORKER, 2, [str(recipe), *background, "checkpoint.resume=auto"], timeout_s=900)
    uninterrupted, resumed = read_metrics(full / "metrics.jsonl"), read_metrics(cut / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]  # 4 steps, then the final evaluation
    assert "eval/accuracy" in resumed[-1]
    assert _comparable(resumed) == _comparable(uninterrupted)
    # the generated text too: the resumed run's samples.jsonl was cut back to step 1 and continued
    assert read_metrics(cut / "samples.jsonl") == read_metrics(full / "samples.jsonl")

    run_torchrun(WORKER, 2, [str(recipe), *background, "checkpoint.resume=auto"], timeout_s=900)
    assert _comparable(read_metrics(cut / "metrics.jsonl")) == _comparable(resumed)
