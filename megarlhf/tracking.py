"""Experiment tracking: the run's per-step scalars and resolved config in TensorBoard, W&B or MLflow.

``logging.backends`` names the trackers of a run; each is a class in :data:`TRACKERS` with one
signature, ``Tracker(settings, run_dir, params, resume_after_step)``, and two methods,
``log(step, metrics)`` and ``close()``. Only the backends a run names are imported (``wandb`` and
``mlflow`` are optional packages: ``pip install megarlhf[tracking]``). Only global rank 0 opens them
(:class:`megarlhf.metrics.MetricsRecorder` calls them next to ``metrics.jsonl``).

What each backend gets:
- the resolved config as the run's parameters (W&B's run config, nested; MLflow params, flattened to
  ``section.key`` with lists as JSON, values cut at MLflow's 6000-character limit: ``config.yaml`` in
  the run directory stays the whole truth);
- every recorded step's scalars, at that step. MLflow's metric names allow no ``@``, so
  ``eval/pass@8`` is logged there as ``eval/pass_at_8`` (other characters MLflow refuses become ``_``).

Resume continues the same run: the W&B and MLflow run ids live in ``<run_dir>/tracking.json`` (written
atomically), and a resumed run (``resume_after_step >= 0``) reopens them; a fresh start opens new runs.
Steps after the checkpoint that the interrupted run had already logged are logged again: TensorBoard
drops the old ones (``purge_step``); W&B and MLflow keep both points at that step (neither has an API
to delete them), the later one being the resumed run's. W&B logs against the ``step`` metric rather
than its own monotone ``_step``, so that the re-logged steps are not refused.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from megarlhf.errors import ConfigError
from megarlhf.registry import Registry

if TYPE_CHECKING:
    from megarlhf.config.schema import LoggingConfig

TRACKERS: Registry[type] = Registry("tracking backend")
STATE_FILE = "tracking.json"
MLFLOW_MAX_PARAM_LENGTH = 6000  # MLflow refuses longer parameter values
MLFLOW_BATCH = 100  # MLflow's limit on parameters per log_batch call


def read_run_ids(run_dir: str | Path) -> dict[str, str]:
    """``{backend: run id}`` recorded in ``<run_dir>/tracking.json`` (empty when there is none)."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        return {}
    try:
        ids = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); delete it to start new tracking runs") from None
    if not isinstance(ids, dict) or not all(isinstance(v, str) for v in ids.values()):
        raise ConfigError(f"{path}: expected an object of backend -> run id strings, got {ids!r}")
    return ids


def record_run_id(run_dir: str | Path, backend: str, run_id: str) -> None:
    """Adds ``backend: run_id`` to ``<run_dir>/tracking.json``, atomically."""
    run_dir = Path(run_dir)
    ids = {**read_run_ids(run_dir), backend: run_id}
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{STATE_FILE}.")
    with os.fdopen(fd, "w") as f:
        json.dump(ids, f, indent=1)
    os.replace(tmp, run_dir / STATE_FILE)


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optim.lr": "1e-05", ...}``: nested mappings joined by ``.``, lists and None as JSON."""
    flat = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, name + "."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat


def mlflow_metric_name(key: str) -> str:
    """``key`` in the characters MLflow accepts (slashes, word characters, ``.-: `` and spaces)."""
    return re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))


def _run_name(settings: "LoggingConfig", run_dir: Path) -> str:
    return settings.run_name or run_dir.resolve().name


@TRACKERS.register("tensorboard")
class TensorBoardTracker:
    """Scalars as TensorBoard events under ``<run_dir>/tensorboard`` (a resumed run purges the steps
    after its checkpoint). TensorBoard has no run parameters: the config is ``config.yaml``."""

    def __init__(self, settings: "LoggingConfig", run_dir: Path, params: Mapping[str, Any],
                 resume_after_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                     purge_step=resume_after_step + 1 if resume_after_step >= 0 else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@TRACKERS.register("wandb")
class WandbTracker:
    """A W&B run under project ``logging.project``, files in ``<run_dir>/wandb``; ``logging.wandb_mode``
    (or W&B's own ``WANDB_MODE``) chooses online or offline. The run's config is the resolved config."""

    def __init__(self, settings: "LoggingConfig", run_dir: Path, params: Mapping[str, Any],
                 resume_after_step: int):
        wandb = _import_backend("wandb")
        run_id = read_run_ids(run_dir).get("wandb") if resume_after_step >= 0 else None
        resuming = run_id is not None
        run_id = run_id or secrets.token_hex(6)  # W&B run ids: short, lowercase alphanumeric
        # console="off": the run's stdout stays ours (W&B would otherwise wrap it to upload a copy)
        self._run = wandb.init(project=settings.project, name=_run_name(settings, run_dir), dir=str(run_dir),
                               id=run_id, resume="allow" if resuming else "never", mode=settings.wandb_mode,
                               config=None if resuming else dict(params),
                               settings=wandb.Settings(console="off", quiet=True))
        if resuming:
            self._run.config.update(dict(params), allow_val_change=True)
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        record_run_id(run_dir, "wandb", run_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({"step": step, **metrics})

    def close(self) -> None:
        self._run.finish()


@TRACKERS.register("mlflow")
class MlflowTracker:
    """An MLflow run in experiment ``logging.project`` at ``logging.mlflow_tracking_uri`` (None: MLflow's
    own choice, ``MLFLOW_TRACKING_URI`` or its default), the resolved config as its parameters."""

    def __init__(self, settings: "LoggingConfig", run_dir: Path, params: Mapping[str, Any],
                 resume_after_step: int):
        mlflow = _import_backend("mlflow")
        from mlflow.entities import Param

        self._mlflow = mlflow
        uri = settings.mlflow_tracking_uri
        try:
            self._client = mlflow.MlflowClient(tracking_uri=uri)
            run_id = read_run_ids(run_dir).get("mlflow") if resume_after_step >= 0 else None
            if run_id is not None:
                self._client.update_run(run_id, status="RUNNING")
            else:
                experiment = self._client.get_experiment_by_name(settings.project)
                experiment_id = (experiment.experiment_id if experiment is not None
                                 else self._client.create_experiment(settings.project))
                run_id = self._client.create_run(experiment_id, run_name=_run_name(settings, run_dir)).info.run_id
                flat = [Param(k, v[:MLFLOW_MAX_PARAM_LENGTH]) for k, v in flatten_params(params).items()]
                for start in range(0, len(flat), MLFLOW_BATCH):
                    self._client.log_batch(run_id, params=flat[start:start + MLFLOW_BATCH])
        except (mlflow.exceptions.MlflowException, ImportError) as err:
            raise ConfigError(f"logging.backends has mlflow, but MLflow at tracking URI "
                              f"{uri or mlflow.get_tracking_uri()!r} cannot open the run: {err}") from err
        self._run_id = run_id
        record_run_id(run_dir, "mlflow", run_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_metric_name(k), v, now, step) for k, v in metrics.items()]
        self._client.log_batch(self._run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def _import_backend(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise ConfigError(f"logging.backends has {name!r}, but the {name} package is not installed "
                          f"(pip install 'megarlhf[tracking]')") from None


def open_trackers(settings: "LoggingConfig", run_dir: str | Path, params: Mapping[str, Any],
                  resume_after_step: int) -> list:
    """The trackers ``settings.backends`` names, opened for ``run_dir`` (call on global rank 0 only);
    ``resume_after_step`` is the checkpoint's last completed step, -1 for a fresh start."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    opened = []
    try:
        for name in settings.backends:
            opened.append(TRACKERS.get(name)(settings, run_dir, params, resume_after_step))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened

