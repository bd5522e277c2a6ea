"""CombinedReward: weighted sum, failure reports, timeouts with bounded wall time (threads for functions
declared in_process, killable worker processes for the others), reward-model slot."""
from __future__ import annotations

import threading
import time

import pytest

from megarlhf.rewards import CombinedReward, RewardInput
from megarlhf.config.reward import RewardConfig, RewardSpec
from megarlhf.rewards.api import in_process
from megarlhf.testing.hostile import alive, live_children

# test-local reward functions, named by dotted path like a user's
def length_reward(sample, scale=1.0):
    return scale * len(sample.response)


def raising_reward(sample):
    if "boom" in sample.response:
        raise RuntimeError(f"cannot score {sample.response!r}")
    return 1.0


@in_process  # its kwargs hold a threading.Event: it tests the thread pool
def sleeping_reward(sample, release: threading.Event):
    if "hang" in sample.response:
        release.wait()  # set only after the test has measured the wall time: sleeps "forever"
    return 2.0


def invalid_reward(sample):
    return {"nan": float("nan"), "none": None}.get(sample.response, 1.0)


def printing_reward(sample):
    """Writes to descriptor 1 as a user's reward can: a print, a raw write and a subprocess's output."""
    import os
    import subprocess

    print("a print that is not a reply")
    os.write(1, b"hold")  # four bytes a reply frame would read as its length
    subprocess.run(["sh", "-c", "printf 'a subprocess writing to stdout'; read line || true"], check=True)
    return 1.0


def numpy_reward(sample):
    import numpy

    return numpy.float32(0.5) if sample.response == "float" else numpy.int64(2)


@in_process
def numpy_reward_in_process(sample):
    return numpy_reward(sample)


def exiting_spawner_reward(sample, pid_file: str):
    """Starts a child that would sleep for 1000 s, then ends its worker process."""
    import os
    import subprocess

    child = subprocess.Popen(["sleep", "1000"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    os._exit(3)


def spawning_reward(sample, pid_file: str):
    """Starts a child that would sleep for 1000 s, then hangs past its time limit."""
    import subprocess

    child = subprocess.Popen(["sleep", "1000"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(1000)


HERE = __name__


def _samples(*responses):
    return [RewardInput(prompt=f"prompt {i}: " + "x" * 300, response=r, ground_truth="42")
            for i, r in enumerate(responses)]


def test_weights_combine():
    config = RewardConfig(functions=[RewardSpec("numeric", weight=2.0),
                                     RewardSpec(f"{HERE}:length_reward", weight=0.5, kwargs={"scale": 0.1})])
    reward = CombinedReward(config)
    responses = ["#### 42", "#### 41", "The answer is 42."]
    result = reward(_samples(*responses))
    want_numeric = [1.0, 0.0, 1.0]
    want_length = [0.1 * len(r) for r in responses]
    assert result.components["numeric"] == want_numeric
    assert result.components[f"{HERE}:length_reward"] == pytest.approx(want_length, abs=1e-12)
    assert result.rewards == pytest.approx([2.0 * a + 0.5 * b for a, b in zip(want_numeric, want_length)], abs=1e-12)
    assert result.failures == [] and result.metrics["reward/failures"] == 0.0
    assert result.metrics["reward/numeric/mean"] == pytest.approx(2 / 3)
    reward.close()


def test_raising_function_is_reported_and_batch_still_scored():
    config = RewardConfig(functions=[RewardSpec(f"{HERE}:raising_reward"), RewardSpec("exact_match")],
                          failure_reward=-1.0)
    reward = CombinedReward(config)
    result = reward(_samples("#### 42", "boom #### 42", "#### 7"))
    assert result.components[f"{HERE}:raising_reward"] == [1.0, -1.0, 1.0]
    assert result.components["exact_match"] == [1.0, 1.0, 0.0]
    assert result.rewards == [2.0, 0.0, 1.0]
    [failure] = result.failures
    assert (failure.index, failure.kind, failure.name) == (1, "error", f"{HERE}:raising_reward")
    assert "RuntimeError: cannot score 'boom #### 42'" in failure.message
    assert failure.prompt.startswith("prompt 1: ") and failure.prompt.endswith("(310 chars)")
    assert len(failure.prompt) < 250 and failure.response == "boom #### 42"
    assert "sample 1" in str(failure)
    assert result.metrics["reward/failures"] == 1.0 and result.metrics["reward/timeouts"] == 0.0
    reward.close()


def test_invalid_return_values_are_failures():
    reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:invalid_reward")]))
    result = reward(_samples("nan", "ok", "none"))
    assert result.rewards == [0.0, 1.0, 0.0]
    assert [(f.index, f.kind) for f in result.failures] == [(0, "invalid"), (2, "invalid")]
    reward.close()


def test_hanging_function_has_bounded_wall_time():
    timeout = 0.5
    release = threading.Event()
    config = RewardConfig(functions=[RewardSpec(f"{HERE}:sleeping_reward", kwargs={"release": release}),
                                     RewardSpec("numeric")],
                          timeout_s=timeout, num_workers=2, failure_reward=0.0)
    reward = CombinedReward(config)
    responses = ["hang", "#### 42", "hang", "#### 1", "hang", "#### 42"]
    start = time.monotonic()
    result = reward(_samples(*responses))
    wall = time.monotonic() - start
    # 3 hung calls on 2 workers: two time out together, the third after a replacement worker takes it
    assert 2 * timeout <= wall < 2 * timeout + 1.5
    assert result.components[f"{HERE}:sleeping_reward"] == [0.0, 2.0, 0.0, 2.0, 0.0, 2.0]
    assert result.components["numeric"] == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert [(f.index, f.kind) for f in result.failures] == [(0, "timeout"), (2, "timeout"), (4, "timeout")]
    assert result.metrics["reward/timeouts"] == 3.0 and result.metrics["reward/abandoned_threads"] == 3.0
    # the pool kept its size: a second batch is scored at normal speed
    start = time.monotonic()
    again = reward(_samples("#### 42", "ok"))
    assert time.monotonic() - start < timeout and again.failures == []
    # an abandoned thread whose call finally returns leaves the pool
    release.set()
    deadline = time.monotonic() + 5.0
    while reward.pool.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reward.pool.abandoned == 0
    reward.close()


def test_reward_model_slot():
    config = RewardConfig(functions=[RewardSpec("exact_match")], reward_model_path="/models/rm",
                          reward_model_weight=0.25)
    calls = []

    def model(samples):
        calls.append(len(samples))
        return [float(len(s.response)) for s in samples]

    reward = CombinedReward(config, reward_model=model)
    result = reward(_samples("#### 42", "#### 4"))
    assert calls == [2]
    assert result.components["reward_model"] == [7.0, 6.0]
    assert result.rewards == [1.0 + 0.25 * 7.0, 0.25 * 6.0]
    reward.close()
    with pytest.raises(ValueError, match="reward.reward_model_path and its scorer go together"):
        CombinedReward(config)
    with pytest.raises(ValueError, match="returned 1 scores for 2 samples"):
        CombinedReward(config, reward_model=lambda s: [1.0])(_samples("a", "b"))


def test_a_reward_models_non_finite_score_is_a_counted_failure_of_that_sample():
    config = RewardConfig(functions=[RewardSpec("exact_match")], reward_model_path="/models/rm",
                          failure_reward=-1.0)
    reward = CombinedReward(config, reward_model=lambda samples: [2.0, float("nan"), float("inf")])
    result = reward(_samples("#### 42", "#### 42", "#### 4"))
    assert result.components["reward_model"] == [2.0, -1.0, -1.0] and result.rewards == [3.0, 0.0, -1.0]
    assert [(f.index, f.name, f.kind) for f in result.failures] == [(1, "reward_model", "invalid"),
                                                                    (2, "reward_model", "invalid")]
    assert result.metrics["reward/failures"] == 2.0
    reward.close()


# ---- worker processes: what a thread cannot bound ---------------------------------------------------------
def hostile_reward(sample):
    """Misbehaves as the response says (megarlhf.testing.hostile); scores 3.0 otherwise."""
    from megarlhf.testing.hostile import misbehave

    allocated = misbehave(sample.response)
    return 3.0 if allocated is None else float(allocated)


def _worker_pids(reward) -> set[int]:
    return {worker.process.pid for worker in reward.processes._workers}


def test_hostile_calls_are_killed_in_bounded_time_and_their_workers_replaced():
    timeout = 1.0
    reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:hostile_reward")], timeout_s=timeout,
                                         num_workers=2, worker_memory_mb=1024))
    assert reward(_samples("fine")).rewards == [3.0]  # the workers started (not timed: start-up is excluded)
    first = _worker_pids(reward)
    responses = ["regex", "fine", "hang", "spin", "segfault", "exit", "memory", "fine"]
    start = time.monotonic()
    result = reward(_samples(*responses))
    wall = time.monotonic() - start
    # 3 calls time out (1 s each) on 2 workers, and every killed worker is restarted (~0.5 s each)
    assert wall < 3 * timeout + 6 * 2.0
    assert result.components[f"{HERE}:hostile_reward"] == [0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]
    kinds = {f.index: f.kind for f in result.failures}
    assert kinds == {0: "timeout", 2: "timeout", 3: "timeout", 4: "error", 5: "error", 6: "error"}
    messages = {f.index: f.message for f in result.failures}
    assert "died during the call" in messages[4] and "exit code 3" in messages[5]
    assert "MemoryError" in messages[6]  # the address-space limit: the worker survives and reports it
    assert result.metrics["reward/killed_workers"] == 5.0 and result.metrics["reward/timeouts"] == 3.0
    assert not first & _worker_pids(reward) or len(first & _worker_pids(reward)) <= 1
    dead = [pid for pid in first - _worker_pids(reward) if alive(pid)]
    assert dead == []  # killed workers are gone, not left running
    assert reward(_samples("fine", "fine", "fine")).rewards == [3.0] * 3  # the pool kept its size
    reward.close()
    assert not any(alive(pid)
                   for pid in _worker_pids(reward))


@pytest.mark.slow  # ~25 s: every timed-out worker is replaced by a fresh interpreter
def test_a_hundred_hanging_calls_leave_nothing_behind():
    threads, children = threading.active_count(), len(live_children())  # other tests' workers may still run
    reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:hostile_reward")], timeout_s=0.3,
                                         num_workers=4))
    start = time.monotonic()
    result = reward(_samples(*["hang"] * 100))
    assert result.metrics["reward/timeouts"] == 100.0
    assert time.monotonic() - start < 100 / 4 * (0.3 + 2.0)
    assert threading.active_count() <= threads  # no thread is abandoned
    assert len(live_children()) <= children + 4  # the 4 live workers
    reward.close()


def test_a_function_a_worker_cannot_import_is_named():
    reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:hostile_reward")]))
    reward.processes.names = ["no_such_module:fn"]
    result = reward(_samples("fine"))
    assert result.failures[0].kind == "error" and "could not start" in result.failures[0].message
    assert "no_such_module" in result.failures[0].message
    reward.close()


def test_workers_are_reached_from_a_process_holding_many_files():
    """A trainer holds well over 1,023 descriptors (engines, checkpoints, sockets); select() refuses those,
    which once left the pool's threads dead and the next batch waiting forever."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit ({hard}) is below what the test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    files = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:hostile_reward")], num_workers=2))
        assert reward(_samples("fine", "fine", "fine")).rewards == [3.0] * 3
        assert reward(_samples("fine", "fine", "fine")).rewards == [3.0] * 3
        reward.close()
    finally:
        for fd in files:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def closing_reward(sample):
    """Closes the worker's pipes (every descriptor past stderr, wherever the reply pipe is) and stays alive."""
    import os

    os.closerange(3, 4096)
    time.sleep(1000)


def test_a_worker_that_closes_its_reply_pipe_is_killed_at_the_deadline():
    # the parent read end-of-file and waited for the worker to exit, with no time limit: forever
    reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:closing_reward")], timeout_s=1.0))
    done = []
    thread = threading.Thread(target=lambda: done.append(reward(_samples("any"))), daemon=True)
    thread.start()
    thread.join(timeout=20.0)
    assert done, "the reward call did not return"
    [failure] = done[0].failures
    assert failure.kind == "error" and "closed its reply pipe" in failure.message
    assert done[0].metrics["reward/killed_workers"] == 1.0
    reward.close()


def huge_reward(sample):
    return 10**400


def test_an_integer_too_large_for_a_float_is_an_invalid_reward():
    # float(10**400) raises OverflowError: the check itself crashed the runner
    reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:huge_reward")]))
    result = reward(_samples("any"))
    reward.close()  # its worker would outlive the test and count as another test's leftover
    assert result.rewards == [0.0] and result.failures[0].kind == "invalid"


def test_a_functions_output_and_its_subprocesses_never_reach_the_replies():
    reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:printing_reward")], timeout_s=10.0))
    result = reward(_samples("a", "b"))
    reward.close()
    assert result.rewards == [1.0, 1.0] and not result.failures, [str(f) for f in result.failures]


def test_numpy_numbers_are_rewards_in_a_worker_as_in_process():
    for function in ("numpy_reward", "numpy_reward_in_process"):
        reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:{function}")], timeout_s=10.0))
        result = reward(_samples("float", "int"))
        reward.close()
        assert result.rewards == [0.5, 2.0] and not result.failures, [str(f) for f in result.failures]


@pytest.mark.parametrize("function, kind", [("spawning_reward", "timeout"), ("exiting_spawner_reward", "error")])
def test_a_killed_or_dead_workers_children_die_with_it(tmp_path, function, kind):
    pid_file = tmp_path / "child.pid"
    reward = CombinedReward(RewardConfig(functions=[RewardSpec(f"{HERE}:{function}",
                                                               kwargs={"pid_file": str(pid_file)})],
                                         timeout_s=1.0, num_workers=1))
    result = reward(_samples("x"))
    assert result.failures[0].kind == kind
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5.0
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    reward.close()
    assert not alive(child), "a child of the killed worker outlived it"
