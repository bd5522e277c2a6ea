"""Host synchronisations of the trainer's part of an RL step do not grow with the model or the batch
layout (issue 21, item 3).

The worker (:mod:`_worker_host_syncs`) counts every device-to-host read (``.item()``, ``.tolist()``,
``.cpu()``, ``.numpy()``, ``float/int/bool(tensor)``) while the actor and reference score a batch, the
critic values it, and the actor and critic each take one optimizer step, at 2 and 4 layers and at one
and five micro-batches per pass. On a GPU each read stalls the host until the device's queue drains;
before this change the count grew with every layer (the attention's segment boundaries and the rotary
table), every micro-batch (metrics, packing, the target check) and every segment (331 to 1135 reads).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megarlhf.testing.launch import read_rank_results, run_torchrun

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict:
    work, out = tmp_path_factory.mktemp("host_sync_models"), tmp_path_factory.mktemp("host_syncs")
    run_torchrun(HERE / "_worker_host_syncs.py", 1, [str(work), str(out)], timeout_s=600)
    return read_rank_results(out, 1)[0]


def test_host_reads_per_step_do_not_grow_with_layers_parameters_micro_batches_or_segments(counts):
    small, large = counts["small/one_micro_batch"], counts["large/five_micro_batches"]
    assert small["micro_batches"] == 1 and large["micro_batches"] == 5  # the layouts really differ
    assert small["segments"] != large["segments"]
    per_run = {name: run["count"] for name, run in counts.items()}
    assert len(set(per_run.values())) == 1, (per_run, {name: run["where"] for name, run in counts.items()})
    # a handful per optimizer step and per scoring pass (metrics, non-finite verdict, normaliser, plan)
    assert per_run["small/one_micro_batch"] <= 25, counts["small/one_micro_batch"]["where"]
    grpo = {name: run["grpo_count"] for name, run in counts.items()}
    assert len(set(grpo.values())) == 1, (grpo, {name: run["grpo_where"] for name, run in counts.items()})


def test_only_the_optimizers_host_step_counters_scale_with_parameters(counts):
    """torch's Adam reads its per-parameter step counters, which live on the host (not a device sync)."""
    assert counts["large/one_micro_batch"]["host_steps"] > counts["small/one_micro_batch"]["host_steps"]
    for run in counts.values():
        assert all("optimizer.py" in site or "cpu_compat.py" in site for site in run["host_step_sites"]), run
