"""NeMo-Run experiments for megarlhf: a :class:`RunConfig` in Python -> a task on every rank -> an executor.

An experiment is described in Python with the same dataclasses the YAML recipes fill (build a RunConfig
directly, or :func:`megarlhf.config.load_config` a recipe and adjust it); there is no second config path:
:func:`megarlhf_task` writes the resolved config with :func:`megarlhf.config.save_config` into the job
directory and the task runs ``python -m megarlhf COMMAND that.yaml`` on every rank, which loads it back
into an equal RunConfig.

Executors (NeMo-Run's own; see docs/PLATFORM.md for the pins and the two path gotchas):

* :func:`local_executor`: ``run.LocalExecutor`` with NeMo-Run's torchrun launcher, N ranks on this host;
* :func:`slurm_executor`: ``run.SlurmExecutor`` with one task per GPU launched by srun (megarlhf reads
  rank, world size and the rendezvous from Slurm's environment), requeue on preemption (the run resumes:
  ``checkpoint.resume=auto``), a local tunnel by default or an SSH tunnel to a login node.

:func:`run_experiment` runs one task and returns its final state.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from megarlhf.config import save_config
from megarlhf.config.schema import RunConfig

# One port per job id, so that jobs sharing a node do not collide; megarlhf reads both (parallel.runtime).
RENDEZVOUS_LINES = ('export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"\n'
                    'export MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"\n')
QUIET_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _check_home(path: Path) -> None:
    if "/nemo_run" in str(path):
        raise ValueError(f"{path}: NeMo-Run rewrites paths containing '/nemo_run'; choose a job directory "
                         f"without that substring")


def megarlhf_task(config: RunConfig, job_dir: str | os.PathLike, command: str = "train", env: dict | None = None,
                  python: str = "python"):
    """A ``run.Script`` running ``python -m megarlhf COMMAND <job_dir>/config.yaml`` (config saved now).
    ``python``: the interpreter on the ranks' machines (a path there, or found on their PATH)."""
    import nemo_run as run

    if command not in ("train", "sft", "eval"):
        raise ValueError(f"megarlhf_task: command must be train, sft or eval, got {command!r}")
    from megarlhf.run.checks import check_config

    check_config(config)  # a misspelt registry name fails here, not once the job has its nodes
    job_dir = Path(job_dir).absolute()
    _check_home(job_dir)
    path = save_config(config, job_dir / "config.yaml")
    return run.Script(path="megarlhf", m=True, args=[command, str(path)], entrypoint=python, env=dict(env or {}))


def _pythonpath() -> str:
    """The directory holding the megarlhf package, so ranks import this checkout."""
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def local_executor(nproc: int, env: dict | None = None):
    """``nproc`` ranks on this host under NeMo-Run's torchrun launcher (this interpreter's torchrun:
    its directory goes first on PATH, so a venv works without being activated)."""
    import nemo_run as run

    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun",
                             env_vars={**QUIET_ENV, "PYTHONPATH": _pythonpath(), "PATH": path, **(env or {})})


@dataclass(frozen=True)
class SlurmJob:
    """A Slurm allocation: one srun task per GPU (``tasks_per_node``) on ``nodes`` nodes.

    ``account``: the Slurm account (NeMo-Run needs one; a cluster without accounting ignores it).
    ``host``: submit through an SSH tunnel to that login node (``user`` there), job files under ``job_dir``
    there; None: this machine runs sbatch itself (a local tunnel; the job files then live in NeMo-Run's
    home, see :func:`run_experiment`). ``gpus_per_node=None`` asks for no GPUs (CPU clusters, tests).
    ``setup_lines``: shell lines run before srun (e.g. activating the environment); the rendezvous
    (MASTER_ADDR = the first node, MASTER_PORT derived from the job id) is exported before them.
    """

    nodes: int
    tasks_per_node: int
    job_dir: str | os.PathLike
    account: str
    partition: str | None = None
    time: str = "04:00:00"
    gpus_per_node: int | None = None
    host: str | None = None
    user: str | None = None
    container_image: str | None = None
    setup_lines: str | None = None


def slurm_executor(job: SlurmJob, env: dict | None = None):
    """NeMo-Run's executor for ``job``, with ``env`` added to the tasks' environment."""
    import nemo_run as run

    job_dir = str(Path(job.job_dir).absolute())
    _check_home(Path(job_dir))
    tunnel = run.SSHTunnel(host=job.host, user=job.user or os.environ.get("USER", ""), job_dir=job_dir) if job.host \
        else run.LocalTunnel(job_dir=job_dir)
    return run.SlurmExecutor(
        account=job.account, partition=job.partition, nodes=job.nodes, ntasks_per_node=job.tasks_per_node,
        gpus_per_node=job.gpus_per_node, time=job.time, tunnel=tunnel, packager=run.Packager(),
        container_image=job.container_image, setup_lines=RENDEZVOUS_LINES + (job.setup_lines or ""),
        env_vars={**QUIET_ENV, "PYTHONPATH": _pythonpath(), **(env or {})},
        # preempted or failed nodes: Slurm puts the job back in the queue, the run resumes from its
        # latest checkpoint (checkpoint.resume=auto)
        additional_parameters={"requeue": True}, open_mode="append")


def _set_home(home: str | os.PathLike) -> None:
    """NeMo-Run's state directory (it reads NEMORUN_HOME once, at import: set it through its setter)."""
    from nemo_run.config import set_nemorun_home

    home = Path(home).absolute()
    _check_home(home)
    set_nemorun_home(str(home))


def _align_local_tunnel(executor, home: str | os.PathLike) -> None:
    """With a local tunnel NeMo-Run writes a job's files under ``<home>/experiments`` and submits them
    from ``<tunnel.job_dir>/<experiment>/<id>``: the two must be the same directory."""
    tunnel = getattr(executor, "tunnel", None)
    if tunnel is not None and type(tunnel).__name__ == "LocalTunnel":
        tunnel.job_dir = str(Path(home).absolute() / "experiments")


def sbatch_script(task, executor, *, name: str, home: str | os.PathLike) -> str:
    """The sbatch script NeMo-Run would submit for ``task`` on a Slurm ``executor`` (nothing is submitted).
    Reads the dry run's torchx request (``Job._dryrun_info``: NeMo-Run keeps it on the job, no accessor)."""
    import nemo_run as run

    _set_home(home)
    _align_local_tunnel(executor, home)
    with run.Experiment(name, log_level="WARN") as experiment:
        experiment.add(task, executor=executor, name=name)
        experiment.dryrun(log=False)
        return experiment.jobs[0]._dryrun_info.request.materialize()


def run_experiment(name: str, task, executor, *, home: str | os.PathLike, detach: bool = False) -> str:
    """Runs ``task`` on ``executor`` as NeMo-Run experiment ``name``; returns the task's final state
    (e.g. "SUCCEEDED"), or "SUBMITTED" when ``detach``. ``home``: NeMo-Run's state directory."""
    import nemo_run as run

    _set_home(home)
    _align_local_tunnel(executor, home)
    with run.Experiment(name, log_level="WARN") as experiment:
        experiment.add(task, executor=executor, name=name)
        experiment.run(sequential=True, detach=detach, tail_logs=False)
    # leaving the block waits for an attached experiment's job and records its final state
    return "SUBMITTED" if detach else experiment.jobs[0].state.name
