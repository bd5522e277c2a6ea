"""Process start-up for every megarlhf job: torch.distributed, Megatron parallel state, seeding, and the
:class:`Runtime` that the rest of megarlhf reads instead of Megatron's global state.

One entry point, :func:`init_parallel`, turns the launcher's environment (torchrun, Slurm's srun, or
no launcher at all) and a :class:`~megarlhf.config.parallel.ParallelConfig` into an initialised default process
group (gloo on CPU, nccl on GPU) and Megatron-Core's tensor/pipeline/context/data-parallel groups, and
returns a :class:`Runtime`: this rank's device (``cuda:<local_rank>`` or ``cpu``), its groups, and one
helper for the bookkeeping collectives (metric sums, token counts, verdicts). Without CUDA it first
activates :mod:`parallel.cpu_compat`; on any device it installs :mod:`parallel.megatron_fallbacks`.

Bookkeeping collectives run on the runtime's device over the same groups as the training (nccl on GPU,
gloo on CPU) rather than over a second set of gloo groups: the numbers they reduce mostly come out of
device computations already, one group per purpose is simpler to reason about, and the cost is small
(on CPU, tests/parallel/test_runtime.py measures it per call; an RL step makes a few dozen such calls).
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from parallel import cpu_compat, megatron_fallbacks
from megarlhf.config.parallel import LayoutError, ParallelConfig


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int  # 0 for a single process: its store binds a free port itself
    launcher: str  # "torchrun", "slurm" or "none"


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[012-015,020],cpu1" -> "gpu012"."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        return "127.0.0.1"
    prefix, ranges = match.groups()
    return prefix + (re.split(r"[-,]", ranges)[0] if ranges else "")


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
    return LaunchEnv(0, 1, 0, "127.0.0.1", 0, "none")


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> LaunchEnv:
    """Initialises the default process group once (gloo without CUDA, nccl with it) and returns the env.

    Calling it again after the group exists is a no-op that returns the same description.
    """
    launch = read_launch_env()
    if not torch.cuda.is_available():
        cpu_compat.activate()
    megatron_fallbacks.install()  # any device: the fallback reads the host once per parameter
    if dist.is_initialized():
        return launch
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    store = None
    if launch.world_size == 1:
        # A world of one needs no outside rendezvous, so it binds port 0 and keeps the socket: choosing a
        # free port first and binding it later races with other processes (EADDRINUSE in CI), and a
        # RANK/WORLD_SIZE/MASTER_PORT inherited from a parent that initialised in-process points at the
        # parent's live store (EADDRINUSE again, in CI's next run).
        store = dist.TCPStore(launch.master_addr, 0, world_size=1, is_master=True,
                              timeout=timedelta(seconds=timeout_s))
        launch = dataclasses.replace(launch, master_port=store.port)
    # Export the rendezvous so that libraries reading env:// (vLLM, Megatron) agree with us; a single
    # process's own store replaces whatever an outer job left in the environment.
    export = os.environ.__setitem__ if store is not None else os.environ.setdefault
    export("MASTER_ADDR", launch.master_addr)
    export("MASTER_PORT", str(launch.master_port))
    os.environ.setdefault("RANK", str(launch.rank))
    os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
    os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
    rendezvous = {"store": store} if store else {"init_method": f"tcp://{launch.master_addr}:{launch.master_port}"}
    dist.init_process_group(backend=backend, rank=launch.rank, world_size=launch.world_size,
                            timeout=timedelta(seconds=timeout_s), **rendezvous)
    return launch


@dataclass(frozen=True)
class ParallelGroup:
    """One of this rank's groups: its size, this rank's index in it, and the torch group (None when this
    rank is alone in it, so there is nothing to communicate)."""

    rank: int
    size: int
    group: object | None  # torch.distributed.ProcessGroup

    @classmethod
    def alone(cls) -> "ParallelGroup":
        return cls(0, 1, None)


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
GROUP_NAMES = ("world", "trainers", "tp", "pp", "cp", "dp", "dp_cp", "replica", "channel", "payload", "ep", "etp",
               "edp")


@dataclass(frozen=True)
class Runtime:
    """Where this rank runs and with whom: the one object training, rollout and the trainers read.

    ``trainers`` holds every rank with Megatron state (the world, except in the disaggregated placement,
    whose engine ranks are left out); verdicts that every trainer must agree on go over it. ``channel``
    (disaggregated placement only; gloo) links the first trainer rank with the engine ranks, and
    ``payload`` the same ranks over the device's backend (NCCL on CUDA, the gloo channel on CPU) for
    tensors that stay on the device. ``dp_cp`` is
    the group DDP averages gradients over (data x context parallel); ``replica`` the TP x PP x CP ranks
    of this rank's model replica (the ranks with its data-parallel rank). ``ep``, ``etp``, ``edp``: the
    expert-parallel, expert-tensor-parallel and expert-data-parallel groups of a mixture-of-experts model
    (``alone`` at EP 1 and TP 1; DDP averages expert gradients over ``edp``). ``is_engine_rank``: a rank of
    the disaggregated placement that only serves a rollout engine (its model groups are ``alone``).
    """

    launch: LaunchEnv
    device: torch.device
    world: ParallelGroup
    trainers: ParallelGroup
    tp: ParallelGroup
    pp: ParallelGroup
    cp: ParallelGroup
    dp: ParallelGroup
    dp_cp: ParallelGroup
    replica: ParallelGroup
    pp_last_global_rank: int  # the global rank of the last pipeline stage of this rank's pipeline
    is_engine_rank: bool = False
    channel: ParallelGroup = ParallelGroup(0, 1, None)
    payload: ParallelGroup = ParallelGroup(0, 1, None)
    ep: ParallelGroup = ParallelGroup(0, 1, None)
    etp: ParallelGroup = ParallelGroup(0, 1, None)
    edp: ParallelGroup = ParallelGroup(0, 1, None)

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def group(self, name: str) -> ParallelGroup:
        if name not in GROUP_NAMES:
            raise ValueError(f"Runtime.group: unknown group {name!r} ({', '.join(GROUP_NAMES)})")
        return getattr(self, name)

    def all_reduce(self, values: Sequence[float], op: str = "sum", over: str = "dp") -> list[float]:
        """Reduces a few bookkeeping numbers (float64, on the runtime's device) over group ``over``;
        every rank of it gets the result. The one helper for metric / count / verdict collectives."""
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        return self.all_reduce_on_device(tensor, op, over).tolist()

    def all_reduce_on_device(self, tensor: torch.Tensor, op: str = "sum", over: str = "dp") -> torch.Tensor:
        """:meth:`all_reduce` of a tensor that stays on the device (in place; no host read), for numbers
        accumulated on the device and read once later."""
        group = self.group(over)
        if group.size > 1:
            dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group.group)
        return tensor

    def any_rank(self, flag: bool, over: str = "trainers") -> bool:
        """True on every rank of ``over`` if ``flag`` is True on any of them."""
        return self.all_reduce([1.0 if flag else 0.0], op="max", over=over)[0] > 0

    def all_gather_objects(self, obj, over: str = "world") -> list:
        """Every rank of ``over``'s ``obj`` (pickled), in rank order."""
        group = self.group(over)
        if group.size == 1:
            return [obj]
        out = [None] * group.size
        dist.all_gather_object(out, obj, group=group.group)
        return out

    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the last pipeline stage holds it, on every stage (in place)."""
        if self.pp.size > 1:
            dist.broadcast(tensor, src=self.pp_last_global_rank, group=self.pp.group)
        return tensor


def _device(launch: LaunchEnv) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", launch.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _megatron_group(size: int, rank: int, make_group) -> ParallelGroup:
    return ParallelGroup(rank, size, make_group() if size > 1 else None)


def _replica_group(dp_rank: int | None) -> ParallelGroup:
    """The group of ranks sharing this rank's data-parallel rank (None: an engine rank, in no replica).
    Collective over the default group: every rank creates every replica's group, in the same order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ParallelGroup.alone()
    world, rank = dist.get_world_size(), dist.get_rank()
    dp_ranks = [None] * world
    dist.all_gather_object(dp_ranks, dp_rank)
    mine = ParallelGroup.alone()
    for replica in sorted({d for d in dp_ranks if d is not None}):
        members = [r for r in range(world) if dp_ranks[r] == replica]
        group = dist.new_group(members) if len(members) > 1 else None
        if replica == dp_rank:
            mine = ParallelGroup(members.index(rank), len(members), group)
    return mine


@dataclass(frozen=True)
class ModelGroups:
    """This rank's model-parallel groups as Megatron's parallel state holds them: the one place outside
    start-up that reads that global state (model converters and checkpoints, which run without a Runtime,
    ask here)."""

    tp: ParallelGroup
    pp: ParallelGroup
    cp: ParallelGroup
    dp: ParallelGroup
    dp_cp: ParallelGroup
    ep: ParallelGroup
    etp: ParallelGroup
    edp: ParallelGroup

    @property
    def initialized(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.model_parallel_is_initialized()


def model_groups() -> ModelGroups:
    """Megatron's groups of this rank (every group ``alone`` before they are initialised)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        alone = ParallelGroup.alone()
        return ModelGroups(alone, alone, alone, alone, alone, alone, alone, alone)
    return ModelGroups(
        tp=_megatron_group(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                           ps.get_tensor_model_parallel_group),
        pp=_megatron_group(ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
                           ps.get_pipeline_model_parallel_group),
        cp=_megatron_group(ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                           ps.get_context_parallel_group),
        dp=_megatron_group(ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group),
        dp_cp=_megatron_group(ps.get_data_parallel_world_size(with_context_parallel=True),
                              ps.get_data_parallel_rank(with_context_parallel=True),
                              lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        ep=_megatron_group(ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
                           ps.get_expert_model_parallel_group),
        etp=_megatron_group(ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                            ps.get_expert_tensor_parallel_group),
        edp=_megatron_group(ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank(),
                            ps.get_expert_data_parallel_group))


def build_runtime(launch: LaunchEnv, trainers: ParallelGroup | None = None, is_engine_rank: bool = False) -> Runtime:
    """The :class:`Runtime` of this rank, read once from Megatron's parallel state (all model groups
    ``alone`` where Megatron has none: a single process, or an engine rank of the disaggregated
    placement). ``trainers``: the trainer ranks' group (None: the whole world)."""
    world = ParallelGroup(dist.get_rank(), dist.get_world_size(), dist.group.WORLD) \
        if dist.is_initialized() and dist.get_world_size() > 1 else ParallelGroup.alone()
    trainers = world if trainers is None else trainers
    device = _device(launch)
    groups = model_groups()
    if is_engine_rank or not groups.initialized:
        alone = ParallelGroup.alone()
        _replica_group(None)  # the trainers create their replica groups collectively
        return Runtime(launch, device, world, trainers, alone, alone, alone, alone, alone, alone, launch.rank,
                       is_engine_rank)
    pp = groups.pp
    last = dist.get_global_rank(pp.group, pp.size - 1) if pp.group is not None else launch.rank
    return Runtime(launch=launch, device=device, world=world, trainers=trainers, tp=groups.tp, pp=pp, cp=groups.cp,
                   dp=groups.dp, dp_cp=groups.dp_cp, replica=_replica_group(groups.dp.rank), pp_last_global_rank=last,
                   ep=groups.ep, etp=groups.etp, edp=groups.edp)


def init_parallel(config: ParallelConfig, seed: int = 1234, backend: str | None = None) -> Runtime:
    """Initialises torch.distributed and Megatron's model-parallel groups, seeds this rank, and returns
    its :class:`Runtime`."""
    launch = init_distributed(backend)
    config.validate(launch.world_size)
    _initialize_megatron(config, local_world_size=None)
    seed_everything(seed)
    return build_runtime(launch)


def _initialize_megatron(config: ParallelConfig, local_world_size: int | None, gloo_groups: bool = True) -> None:
    """(Re)creates Megatron's groups for ``config`` over all ranks, or the first ``local_world_size``; without
    ``gloo_groups`` Megatron makes none of its gloo twins of the data-parallel groups (the optimizer's)."""
    from megatron.core import parallel_state

    global _STAGE_SPLIT
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        local_world_size=local_world_size,
        create_gloo_process_groups=gloo_groups,
    )
    _STAGE_SPLIT = config.uneven_stages


# The uneven pipeline-stage split init_parallel was given: Megatron's parallel state keeps the group sizes
# but not how many layers each stage holds, and every model built afterwards needs the split.
_STAGE_SPLIT: dict[str, int] = {}


def current_layout() -> ParallelConfig:
    """The layout Megatron's groups were initialised with, including the uneven stage split."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    return ParallelConfig(ps.get_tensor_model_parallel_world_size(), pp, ps.get_context_parallel_world_size(),
                          expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                          **(_STAGE_SPLIT if pp > 1 else {}))


def init_disaggregated(config: ParallelConfig, num_trainer_ranks: int, seed: int = 1234,
                       backend: str | None = None) -> Runtime:
    """Like :func:`init_parallel`, but Megatron's groups cover only the trainer ranks ``[0, num_trainer_ranks)``.

    For the disaggregated rollout mode: the remaining ranks hold rollout engines and no Megatron state.
    Every rank must call this (``torch.distributed.new_group`` is collective over the default group even
    for ranks outside the new group); Megatron's ``local_world_size`` makes its rank generator lay out
    TP/PP/CP/DP over the trainer ranks only, so on engine ranks no Megatron group is set and
    ``parallel_state.model_parallel_is_initialized()`` is False. Every group the placement uses is made
    here: the trainers' group, the gloo ``channel`` between the first trainer rank and the engines (for
    objects), and ``payload`` over the same ranks (NCCL on CUDA; on CPU the channel itself) for device
    tensors.

    Then, on trainer ranks, the trainers' group becomes torch.distributed's default group: library code
    that gathers over the default group assuming every rank of the job trains (Megatron's optimizer
    setup, distributed checkpointing, megarlhf's checkpoint barriers) sees exactly the trainers, and the
    engine ranks, which never reach those calls, cannot deadlock them. Trainer ranks are the job's first
    ranks, so their ranks in that group equal their global ranks; ``runtime.world`` keeps the whole job.
    """
    world_size = read_launch_env().world_size
    if not 1 <= num_trainer_ranks < world_size:
        raise LayoutError(f"init_disaggregated: num_trainer_ranks={num_trainer_ranks} must leave at least one of "
                          f"the {world_size} ranks for rollout engines and keep at least one trainer")
    config.validate(num_trainer_ranks)
    launch = init_distributed(backend)
    _initialize_megatron(config, local_world_size=num_trainer_ranks)
    seed_everything(seed)
    # collective: every rank creates every group, in the same order
    trainer_group = dist.new_group(list(range(num_trainer_ranks)))
    channel_ranks = [0, *range(num_trainer_ranks, world_size)]
    channel_group = dist.new_group(channel_ranks, backend="gloo")
    payload_group = dist.new_group(channel_ranks, backend="nccl") if torch.cuda.is_available() else channel_group
    is_engine = launch.rank >= num_trainer_ranks
    trainers = ParallelGroup.alone() if is_engine else ParallelGroup(launch.rank, num_trainer_ranks, trainer_group)
    channel_rank = 0 if launch.rank == 0 else (launch.rank - num_trainer_ranks + 1 if is_engine else None)
    channel = payload = ParallelGroup.alone()
    if channel_rank is not None:
        channel = ParallelGroup(channel_rank, len(channel_ranks), channel_group)
        payload = ParallelGroup(channel_rank, len(channel_ranks), payload_group)
    runtime = dataclasses.replace(build_runtime(launch, trainers, is_engine_rank=is_engine), channel=channel,
                                  payload=payload)
    if not is_engine:
        from torch.distributed import distributed_c10d

        distributed_c10d._world.default_pg = trainer_group
    return runtime


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

    global _STAGE_SPLIT
    _STAGE_SPLIT = {}
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
