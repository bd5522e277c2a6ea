"""parallel.runtime: launcher environments are read correctly, a single process initialises alone, and
the Runtime's groups and bookkeeping collectives agree with Megatron's parallel state on 2 ranks."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarlhf.testing.launch import read_rank_results, run_torchrun
from parallel.runtime import read_launch_env

WORKER = Path(__file__).with_name("_worker_runtime.py")


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "1234"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (3, 8, 1, "torchrun")
    assert (launch.master_addr, launch.master_port) == ("node7", 1234)


def test_slurm_environment_derives_master_from_nodelist():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[012-015],cpu1"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (5, 16, 1, "slurm")
    assert launch.master_addr == "gpu012"


def test_slurm_environment_prefers_explicit_master():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a1", "MASTER_ADDR": "head",
           "MASTER_PORT": "4000"}
    launch = read_launch_env(env)
    assert (launch.master_addr, launch.master_port) == ("head", 4000)


def test_no_launcher_is_a_single_process():
    launch = read_launch_env({})
    assert (launch.rank, launch.world_size, launch.launcher) == (0, 1, "none")
    assert launch.master_port == 0  # bound by init_distributed's store, not chosen ahead


def test_single_process_init_and_reproducible_seeding():
    # A fresh interpreter: init_parallel must work with no launcher variables at all, and seeding twice
    # with the same seed must give the same draws (including inside Megatron's TP RNG tracker).
    # The port: CI failed once with EADDRINUSE, the old runtime having chosen a free port and bound it
    # later (another process took it in between). A single process now binds port 0; a MASTER_PORT left
    # by an outer job (here: a port that is taken) neither stops it nor stays exported for env:// readers.
    script = textwrap.dedent("""
        import os, socket, subprocess, sys, torch
        for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
            os.environ.pop(k, None)
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "10.255.255.1", str(taken.getsockname()[1])
        from megarlhf.config.parallel import ParallelConfig
        from parallel.runtime import init_parallel, seed_everything, shutdown
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        runtime = init_parallel(ParallelConfig(), seed=5)
        assert runtime.launch.world_size == 1 and ps.get_data_parallel_world_size() == 1
        assert runtime.launch.master_port not in (0, taken.getsockname()[1])
        assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", str(runtime.launch.master_port))
        assert runtime.device == torch.device("cpu") and runtime.dp.size == 1 and runtime.dp.group is None
        assert runtime.all_reduce([1.5, 2.0]) == [1.5, 2.0] and not runtime.any_rank(False)
        draws = []
        for _ in range(2):
            seed_everything(5)
            plain = torch.rand(3)
            with get_cuda_rng_tracker().fork():
                tracked = torch.rand(3)
            draws.append((plain, tracked))
        assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
        assert not torch.equal(draws[0][0], draws[0][1])  # the TP stream differs from the default one
        # CI's second EADDRINUSE: a child inherits the RANK/WORLD_SIZE/MASTER_PORT this process exported,
        # and MASTER_PORT is this process's live store. The child must still start on its own port.
        child = subprocess.run([sys.executable, "-c", "from parallel.runtime import init_distributed;"
                                "print('PORT', init_distributed().master_port)"], capture_output=True, text=True)
        assert child.returncode == 0, child.stderr[-3000:]
        assert child.stdout.split()[-1] not in ("0", os.environ["MASTER_PORT"]), child.stdout
        shutdown()
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")


def test_first_slurm_host_handles_bracketed_lists():
    from parallel.runtime import _first_slurm_host

    assert _first_slurm_host("gpu[012,020-022],cpu1") == "gpu012"
    assert _first_slurm_host("login1,login2") == "login1"
    assert _first_slurm_host("") == "127.0.0.1"


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])  # DP2 groups: every 2-rank run uses them
def test_runtime_groups_and_collectives_on_two_ranks(tmp_path, tp):
    run_torchrun(WORKER, 2, [str(tp), str(tmp_path)], timeout_s=300)
    ranks = read_rank_results(tmp_path, 2)
    for rank, result in enumerate(ranks):
        assert result["matches_megatron"], result
        assert result["dp"] == ([rank, 2] if tp == 1 else [0, 1])
        assert result["tp"] == ([0, 1] if tp == 1 else [rank, 2])
        assert result["replica"] == ([0, 1] if tp == 1 else [rank, 2])
        assert result["dp_sum"] == ([1.0 + 2.0, 10.0] if tp == 1 else [1.0 + rank, 5.0])
        assert result["world_max"] == 2.0 and result["any_true"] and not result["any_false"]
        assert result["gathered"] == [0, 1] and result["device"] == "cpu"
    # the cost of one bookkeeping all-reduce over gloo on these 2 cores (reported, loosely bounded)
    assert 0 < ranks[0]["all_reduce_us"] < 50_000
