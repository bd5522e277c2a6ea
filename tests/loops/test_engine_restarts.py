"""Engines that die in the disaggregated placement (DP 2 trainers, 2 engine ranks): the run goes on.

The ``dying`` backend (``_worker_engine_restarts.py``) is the fake engine, whose samples depend on their seeds
alone, dying once on the last engine rank: during a generation (its share comes back empty, the trainers sync a
fresh engine and ask for that share again), between two (the next sync finds it dead and fills a fresh one) or
during a sync's load (the stream is drained, a fresh engine made, and the trainers send everything again).
Against the same run whose engine never dies, every step trains on the same prompts and the same samples, each
exactly once, and every learning number is the same to the bit; one restart is logged.
"""
import json

import pytest

from megarlhf.records.metrics import read_metrics
from megarlhf.testing.launch import run_torchrun

from _rl_recipe import write_recipe

WORKER = "_worker_engine_restarts.py"
SETTINGS = ["rollout.placement={mode: disaggregated, num_engine_ranks: 2}", "rollout.backend=dying",
            "reward.functions=[{name: '_rewards:even_length'}]", "optim.lr=1.0e-3", "eval.every=0",
            "train.steps=4", "logging.samples_per_step=16"]
MEASURED = ("time/", "weight_sync/", "memory/", "rollout/engine_restarts")  # what a restart may change


def _run(tmp_path, assets, mode: str, die_at: int = 3, extra: tuple = ()) -> tuple[list[dict], list[dict]]:
    from pathlib import Path

    run = tmp_path / mode
    recipe = write_recipe(tmp_path / f"{mode}.yaml", assets, "grpo", run)
    run_torchrun(Path(__file__).with_name(WORKER), 4, [mode, str(die_at), str(recipe), *SETTINGS, *extra],
                 timeout_s=900)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return [s for s in samples if s["kind"] == "train"], read_metrics(run / "metrics.jsonl")


@pytest.fixture(scope="module")
def runs(rl_assets, tmp_path_factory):
    cache = {}

    def run(mode: str, die_at: int = 3, extra: tuple = ()):
        if (mode, die_at, extra) not in cache:
            where = tmp_path_factory.mktemp(f"restarts_{mode}_{die_at}")
            cache[mode, die_at, extra] = _run(where, rl_assets, mode, die_at, extra)
        return cache[mode, die_at, extra]

    return run


@pytest.mark.parametrize("mode,die_at", [("during", 3), ("during", 1), ("load", 1),
                                         pytest.param("between", 3, marks=pytest.mark.slow)],
                         ids=["during_step2", "during_step0", "during_a_sync", "between_steps"])
def test_a_dead_engine_is_replaced_and_the_run_trains_on_every_prompt_once(runs, mode, die_at):
    """Dying at step 0 (its first generation) too: the new engine gets the very weights of the checkpoint the
    engines' own load was proven to hold, so the step-0 gate still measures its natural floor (the metrics
    compared below include the calibration's)."""
    whole_samples, whole = runs("none")
    samples, metrics = runs(mode, die_at)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert whole[-1]["rollout/engine_restarts"] == 0.0 and metrics[-1]["rollout/engine_restarts"] == 1.0
    assert metrics[0]["rollout/engine_restarts"] == (1.0 if (mode, die_at) == ("during", 1) else 0.0)
    key = lambda s: (s["step"], s["prompt"], s["response"])  # noqa: E731
    assert sorted(map(key, samples)) == sorted(map(key, whole_samples))
    per_step = {}
    for s in samples:
        per_step.setdefault(s["step"], []).append(s["prompt"])
    assert all(len(prompts) == len(per_step[0]) for prompts in per_step.values())
    for ours, theirs in zip(metrics, whole):
        learned = {k: v for k, v in theirs.items() if not k.startswith(MEASURED)}
        assert {k: ours[k] for k in learned} == learned, ours["step"]


def test_an_engine_that_may_not_be_replaced_stops_the_run_naming_it(rl_assets, tmp_path):
    """With no restarts allowed, the trainers and the dead engine's rank stop with EngineFailedError naming the
    engine rank, as soon as the engine is found dead (not at a collective's timeout)."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    recipe = write_recipe(tmp_path / "r.yaml", rl_assets, "grpo", tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
           str(Path(__file__).with_name(WORKER)), "during", "3", str(recipe), *SETTINGS,
           "rollout.placement.max_engine_restarts=0"]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and time.monotonic() - start < 120
    why = ("engine rank 3: the engine died (EngineCore_0 exit code -9 (test)) and may not be replaced again "
           "(rollout.placement.max_engine_restarts=0, 0 used)")
    for rank in (0, 1):  # the trainers
        assert f"[rank{rank}]: megarlhf.rollout.disaggregated.engine_side.EngineFailedError: disaggregated " \
               f"rollout: {why}" in proc.stderr
    assert f"[rank3]: megarlhf.rollout.disaggregated.engine_side.EngineFailedError: {why}" in proc.stderr


@pytest.mark.slow  # 4 ranks, two vLLM engines and a third started in place of the killed one (~4 min on 2 cores)
def test_a_vllm_engine_core_killed_mid_run_is_replaced(rl_assets, tmp_path):
    """A real death: once step 0 is logged, one engine rank's vLLM engine core is SIGKILLed. The engine rank
    finds it dead at its next command, starts a new engine, the trainers fill it (a verified sync), and the run
    completes with every prompt's samples trained once a step and one restart logged."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from _rl_recipe import WORKER as PLAIN_WORKER

    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", rl_assets, "grpo", run)
    settings = [s for s in SETTINGS if s != "rollout.backend=dying"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone", str(PLAIN_WORKER),
           str(recipe), *settings]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline, killed = time.monotonic() + 600, None
    while killed is None and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
        if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip():
            cores = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                     if "EngineCore" in p.name() or any("EngineCore" in part for part in p.cmdline())]
            if cores:
                killed = cores[-1].pid
                os.kill(killed, signal.SIGKILL)
    output = launcher.communicate(timeout=900)[0]
    assert killed is not None, output[-3000:]
    assert launcher.returncode == 0, output[-6000:]
    assert "the engine died (vLLM's engine core process died" in output
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3] and metrics[-1]["rollout/engine_restarts"] == 1.0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for step in range(4):
        prompts = [s["prompt"] for s in samples if s["kind"] == "train" and s["step"] == step]
        assert len(prompts) == 16 and all(prompts.count(p) == 4 for p in prompts), step


@pytest.mark.parametrize("found_at", ["step2", pytest.param("checkpoint", marks=pytest.mark.slow)])
def test_a_share_generated_again_in_a_pipelined_run_is_stamped_with_the_newer_weights(runs, found_at):
    """rollout.max_staleness=1: batch 2 is launched during step 1 with the weights of version 1, and the last
    engine dies generating it (its 3rd generation). Its lost share is generated again with the trainers' weights
    of when the death is found, version 2: at step 2 when it takes the batch, or (checkpoint.every=2) when the
    checkpoint after step 1's update takes it first. Those samples are not stale at all and the others one version:
    samples.jsonl says which, and the staleness metrics count tokens, not the batch's launch."""
    pipelined = ("rollout.max_staleness=1",) + (("checkpoint.every=2",) if found_at == "checkpoint" else ())
    whole_samples, whole = runs("none", 3, ("rollout.max_staleness=1",))
    samples, metrics = runs("during", 3, pipelined)
    restarts = [m["rollout/engine_restarts"] for m in metrics]
    assert restarts == [0.0, 0.0, 1.0, 1.0]  # found at the checkpoint: logged with the batch, at step 2
    key = lambda s: (s["step"], s["prompt"], s["response"])  # noqa: E731
    assert sorted(map(key, samples)) == sorted(map(key, whole_samples))  # the fake engine's depend on seeds alone
    assert [m["rollout/staleness"] for m in whole] == [0.0, 1.0, 1.0, 1.0] == [m["rollout/staleness"] for m in metrics]
    assert [m["rollout/staleness_mean"] for m in whole] == [0.0, 1.0, 1.0, 1.0]
    versions = {s["step"]: set() for s in samples}
    for s in samples:
        assert sum(n for _, n in s["policy_versions"]) == s["response_tokens"]
        versions[s["step"]] |= {v for v, _ in s["policy_versions"]}
    assert versions == {0: {0}, 1: {0}, 2: {1, 2}, 3: {2}}
    fresh = [s["response_tokens"] for s in samples if s["step"] == 2 and s["policy_versions"][0][0] == 2]
    stale = [s["response_tokens"] for s in samples if s["step"] == 2 and s["policy_versions"][0][0] == 1]
    assert len(fresh) == len(stale) == 8  # the round-robin halves of 2 engines
    assert metrics[2]["rollout/staleness_mean"] == sum(stale) / (sum(stale) + sum(fresh))
