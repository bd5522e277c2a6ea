"""Host synchronisations of the trainer's part of an RL step do not grow with the model or the batch
layout (issue 21, item 3).

The worker (:mod:`_worker_host_syncs`) counts every host synchronisation
(:class:`megarlhf.records.host_syncs.HostSyncCounter`: scalar reads, ``nonzero``, boolean-mask indexing,
``unique``, ``equal``, copies to the host and host data copied to the device) while the actor and reference
score a batch, the critic values it, and the actor and critic each take one optimizer step, at 2 and 4
layers and at one and five micro-batches per pass. On a GPU each one stalls the host until the device's
queue drains. Issue 21 took the count from 331-1135 reads (growing with layers, micro-batches and
segments) to a constant; the wider counter of issue 45 then found 68 (one micro-batch) vs 170 (five):
the log-prob op's ``nonzero`` and the backward's boolean-mask scatter per micro-batch, one small device
tensor per packed row and per micro-batch, and the metric sums copied to the device per micro-batch. Now
32 at every layout.
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
    assert per_run["small/one_micro_batch"] <= 35, counts["small/one_micro_batch"]["where"]
    grpo = {name: run["grpo_count"] for name, run in counts.items()}
    assert len(set(grpo.values())) == 1, (grpo, {name: run["grpo_where"] for name, run in counts.items()})


def test_only_the_optimizers_host_step_counters_scale_with_parameters(counts):
    """torch's Adam reads its per-parameter step counters, which live on the host (not a device sync)."""
    assert counts["large/one_micro_batch"]["host_steps"] > counts["small/one_micro_batch"]["host_steps"]
    for run in counts.values():
        assert all("optimizer.py" in site or "cpu_compat.py" in site for site in run["host_step_sites"]), run
