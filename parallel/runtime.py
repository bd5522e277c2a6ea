"""Process start-up for every megarlhf job: torch.distributed, Megatron parallel state, and seeding.

One entry point, :func:`init_parallel`, turns the launcher's environment (torchrun, Slurm's srun, or
no launcher at all) and a :class:`~parallel.config.ParallelConfig` into an initialised default process
group (gloo on CPU, nccl on GPU) and Megatron-Core's tensor/pipeline/context/data-parallel groups.
Without CUDA it first activates :mod:`parallel.cpu_compat`.
"""
from __future__ import annotations

import os
import random
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from parallel import cpu_compat
from parallel.config import ParallelConfig


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "none"


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[012-015,020],cpu1" -> "gpu012"."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        return "127.0.0.1"
    prefix, ranges = match.groups()
    return prefix + (re.split(r"[-,]", ranges)[0] if ranges else "")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Reads rank and rendezvous information from torchrun, srun, or neither (single process)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR")
            or _first_slurm_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", free_port(), "none")


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> LaunchEnv:
    """Initialises the default process group once (gloo without CUDA, nccl with it) and returns the env.

    Calling it again after the group exists is a no-op that returns the same description.
    """
    launch = read_launch_env()
    if not torch.cuda.is_available():
        cpu_compat.activate()
    if dist.is_initialized():
        return launch
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    # Export the rendezvous so that libraries reading env:// (vLLM, Megatron) agree with us.
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    os.environ.setdefault("RANK", str(launch.rank))
    os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
    os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return launch


def init_parallel(config: ParallelConfig, seed: int = 1234, backend: str | None = None) -> LaunchEnv:
    """Initialises torch.distributed and Megatron's model-parallel groups, then seeds this rank."""
    launch = init_distributed(backend)
    config.validate(launch.world_size)
    _initialize_megatron(config, local_world_size=None)
    seed_everything(seed)
    return launch


def _initialize_megatron(config: ParallelConfig, local_world_size: int | None) -> None:
    """(Re)creates Megatron's groups for ``config`` over all ranks, or the first ``local_world_size``."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        local_world_size=local_world_size,
    )


def init_disaggregated(config: ParallelConfig, num_trainer_ranks: int, seed: int = 1234,
                       backend: str | None = None) -> LaunchEnv:
    """Like :func:`init_parallel`, but Megatron's groups cover only the trainer ranks ``[0, num_trainer_ranks)``.

    For the disaggregated rollout mode: the remaining ranks hold rollout engines and no Megatron state.
    Every rank must call this (``torch.distributed.new_group`` is collective over the default group even
    for ranks outside the new group); Megatron's ``local_world_size`` makes its rank generator lay out
    TP/PP/CP/DP over the trainer ranks only, so on engine ranks no Megatron group is set and
    ``parallel_state.model_parallel_is_initialized()`` is False.
    """
    world_size = read_launch_env().world_size
    if not 1 <= num_trainer_ranks < world_size:
        raise ValueError(f"init_disaggregated: num_trainer_ranks={num_trainer_ranks} must leave at least one of "
                         f"the {world_size} ranks for rollout engines and keep at least one trainer")
    config.validate(num_trainer_ranks)
    launch = init_distributed(backend)
    _initialize_megatron(config, local_world_size=num_trainer_ranks)
    seed_everything(seed)
    return launch


def seed_everything(seed: int) -> None:
    """Seeds Python, NumPy and torch reproducibly per rank, Megatron-style.

    Ranks of different pipeline stages get different streams (offset 100 per stage) so that stages do
    not draw identical dropout masks; data-parallel replicas share a stream. Megatron's tensor-parallel
    RNG tracker is seeded too (on CPU through the compatibility layer), so TP-sharded randomness differs
    per TP rank exactly as on GPU.
    """
    from megatron.core import parallel_state, tensor_parallel

    offset = 0
    if parallel_state.model_parallel_is_initialized():
        offset = 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed + offset)
    np.random.seed(seed + offset)
    torch.manual_seed(seed + offset)
    if parallel_state.model_parallel_is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(seed + offset)


def shutdown() -> None:
    """Tears down Megatron's groups and the default process group (safe to call when neither exists)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
