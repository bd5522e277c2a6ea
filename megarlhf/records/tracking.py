"""Experiment tracking: the run's per-step scalars and resolved config in TensorBoard, W&B or MLflow.

``logging.backends`` names the trackers of a run; each is a class in :data:`TRACKERS` with one
signature, ``Tracker(settings, run_dir, params, resume_after_step)``, and two methods,
``log(step, metrics)`` and ``close(failed=False)``. Only the backends a run names are imported by megarlhf
(``wandb`` and ``mlflow`` are optional packages: ``pip install megarlhf[tracking]``). Only global rank 0
opens them; :meth:`megarlhf.run.context.RunContext.open_recorder` shares the outcome, so a tracker that
cannot open stops every rank with its message instead of leaving the others waiting.

What each backend gets:
- the resolved config as the run's parameters, secrets redacted (W&B's run config, nested; MLflow params, flattened to
  ``section.key`` with lists as JSON, values cut at MLflow's 6000-character limit: ``config.yaml`` in
  the run directory stays the whole truth);
- every recorded step's scalars, at that step. MLflow's metric names allow no ``@``, so
  ``eval/pass@8`` is logged there as ``eval/pass_at_8`` (other characters MLflow refuses become ``_``;
  two names that would meet get ``_2``, ``_3``, ...).

Resume continues the same run: the W&B and MLflow runs live in ``<run_dir>/tracking.json`` (written
atomically, with the project / experiment and tracking URI they belong to, its credentials redacted). A resumed run
(``resume_after_step >= 0``) reopens them; one recorded for another project or URI, or one MLflow no
longer has, is replaced by a new run with a warning. A fresh start opens new runs and rewrites the file.
Steps after the checkpoint that the interrupted run had already logged are logged again: TensorBoard
drops the old ones (``purge_step``); W&B and MLflow keep both points at that step (neither has an API
to delete them), the later one being the resumed run's. W&B logs against the ``step`` metric rather
than its own monotone ``_step``, so that the re-logged steps are not refused.

A run that ends without closing its trackers (an exception escaped the trainer) marks them failed as the
process exits: the MLflow run ``FAILED``, the W&B run finished with exit code 1. A process killed
outright (SIGKILL) cannot; its MLflow run stays ``RUNNING`` until a resume reopens it.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from megarlhf.config.redact import redact, redact_text
from megarlhf.config.train import LoggingConfig
from megarlhf.core.errors import ConfigError
from megarlhf.core.registry import Registry

TRACKERS: Registry[type] = Registry("tracking backend")
STATE_FILE = "tracking.json"
MLFLOW_MAX_PARAM_LENGTH = 6000  # MLflow refuses longer parameter values
MLFLOW_BATCH = 100  # MLflow's limit on parameters per log_batch call
MLFLOW_MAX_NAME_LENGTH = 250
_OPEN: list = []  # trackers opened and not yet closed: marked failed at exit


def _closing(tracker) -> bool:
    """True the first time a tracker closes (it leaves ``_OPEN``); a second close does nothing, so a run
    closed by its owner is never marked failed at exit."""
    if getattr(tracker, "_closed", False):
        return False
    tracker._closed = True
    forget_tracker(tracker)
    return True


def read_tracking_state(run_dir: str | Path) -> dict[str, dict]:
    """``{backend: {"id": run id, ...what it belongs to}}`` from ``<run_dir>/tracking.json`` (empty when
    there is none)."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); delete it to start new tracking runs") from None
    if not isinstance(state, dict) or not all(isinstance(v, dict) and isinstance(v.get("id"), str)
                                              for v in state.values()):
        raise ConfigError(f"{path}: expected {{backend: {{'id': run id, ...}}}}, got {state!r}; "
                          f"delete it to start new tracking runs")
    return state


def read_run_ids(run_dir: str | Path) -> dict[str, str]:
    """``{backend: run id}`` recorded in ``<run_dir>/tracking.json``."""
    return {backend: entry["id"] for backend, entry in read_tracking_state(run_dir).items()}


def _write_state(run_dir: Path, state: Mapping[str, dict]) -> None:
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{STATE_FILE}.")
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, run_dir / STATE_FILE)


def record_run(run_dir: Path, backend: str, run_id: str, owner: Mapping[str, str | None]) -> None:
    """Adds ``backend``'s run and what it belongs to (``owner``: project, URI) to ``tracking.json``."""
    _write_state(run_dir, {**read_tracking_state(run_dir), backend: {"id": run_id, **owner}})


def previous_run(run_dir: Path, backend: str, owner: Mapping[str, str | None]) -> str | None:
    """The run id a resume continues: the recorded one if it belongs to ``owner``, else None (with a
    warning when one was recorded for another owner). A fresh start has none: :func:`open_trackers`
    removed the file."""
    entry = read_tracking_state(run_dir).get(backend)
    if entry is None:
        return None
    recorded = {k: v for k, v in entry.items() if k != "id"}
    if recorded != dict(owner):
        warnings.warn(f"{run_dir / STATE_FILE}: the {backend} run {entry['id']} belongs to {recorded}, this "
                      f"run logs to {dict(owner)}: a new {backend} run is opened", stacklevel=3)
        return None
    return entry["id"]


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
    """``key`` as MLflow accepts it: slashes, word characters and ``.-: `` only, no empty or relative path
    segment, at most 250 characters."""
    name = re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))
    segments = ["_" if part in (".", "..") else part for part in name.split("/") if part]
    return "/".join(segments)[:MLFLOW_MAX_NAME_LENGTH] or "_"


def _run_name(settings: LoggingConfig, run_dir: Path) -> str:
    return settings.run_name or run_dir.resolve().name


@TRACKERS.register("tensorboard")
class TensorBoardTracker:
    """Scalars as TensorBoard events under ``<run_dir>/tensorboard`` (a resumed run purges the steps
    after its checkpoint). TensorBoard has no run parameters: the config is ``config.yaml``."""

    def __init__(self, settings: LoggingConfig, run_dir: Path, params: Mapping[str, Any],
                 resume_after_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                     purge_step=max(resume_after_step + 1, 0))  # a fresh start drops a former run's events

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        if _closing(self):
            self._writer.close()


@TRACKERS.register("wandb")
class WandbTracker:
    """A W&B run under project ``logging.project``, files in ``<run_dir>/wandb``; ``logging.wandb_mode``
    (or W&B's own ``WANDB_MODE``) chooses online or offline. The run's config is the resolved config.
    Online without credentials is refused up front (W&B would otherwise prompt on rank 0's terminal)."""

    def __init__(self, settings: LoggingConfig, run_dir: Path, params: Mapping[str, Any],
                 resume_after_step: int):
        wandb = _import_backend("wandb")
        mode = settings.wandb_mode or os.environ.get("WANDB_MODE", "online")
        if mode in ("online", "run") and not wandb.login(prompt=False, verify=False):
            raise ConfigError("logging.backends has wandb in online mode, but no W&B credentials were found: "
                              "run `wandb login`, set WANDB_API_KEY, or set logging.wandb_mode=offline")
        owner = {"project": settings.project}
        run_id = previous_run(run_dir, "wandb", owner)
        resuming = run_id is not None
        run_id = run_id or secrets.token_hex(6)  # W&B run ids: short, lowercase alphanumeric
        try:
            # console="off": the run's stdout stays ours (W&B would otherwise wrap it to upload a copy)
            self._run = wandb.init(project=settings.project, name=_run_name(settings, run_dir), dir=str(run_dir),
                                   id=run_id, resume="allow" if resuming else "never", mode=settings.wandb_mode,
                                   config=None if resuming else dict(params),
                                   settings=wandb.Settings(console="off", quiet=True))
        except Exception as err:  # noqa: BLE001 - W&B's errors (usage, network, server) all stop the start
            raise ConfigError(f"logging.backends has wandb, but W&B cannot open run {run_id} in project "
                              f"{settings.project!r}: {type(err).__name__}: {err}") from err
        if resuming:
            self._run.config.update(dict(params), allow_val_change=True)
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        record_run(run_dir, "wandb", run_id, owner)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({"step": step, **metrics})

    def close(self, failed: bool = False) -> None:
        if _closing(self):
            self._run.finish(exit_code=1 if failed else 0)


@TRACKERS.register("mlflow")
class MlflowTracker:
    """An MLflow run in experiment ``logging.project`` at ``logging.mlflow_tracking_uri`` (or
    ``MLFLOW_TRACKING_URI``; one of them is required: MLflow's own default, ``sqlite:///mlflow.db`` in the
    working directory, needs the full ``mlflow`` package and moves with the directory a job starts in),
    the resolved config as its parameters."""

    def __init__(self, settings: LoggingConfig, run_dir: Path, params: Mapping[str, Any],
                 resume_after_step: int):
        mlflow = _import_backend("mlflow")
        uri = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise ConfigError("logging.backends has mlflow but no tracking URI: set logging.mlflow_tracking_uri "
                              "(or MLFLOW_TRACKING_URI) to a server (http://host:5000), databricks, a database "
                              "(sqlite:////abs/mlflow.db, with the full mlflow package) or a local store "
                              "(file:/abs/mlruns, with MLFLOW_ALLOW_FILE_STORE=true)")
        owner = {"experiment": settings.project, "uri": redact_text(uri)}  # tracking.json holds no password
        self._names: dict[str, str] = {}
        try:
            self._client = mlflow.MlflowClient(tracking_uri=uri)
            run_id = self._reopen(previous_run(run_dir, "mlflow", owner))
            if run_id is None:
                run_id = self._create(settings, run_dir, params)
        except (mlflow.exceptions.MlflowException, ImportError) as err:
            raise ConfigError(f"logging.backends has mlflow, but MLflow at tracking URI {uri!r} cannot open "
                              f"the run: {err}") from err
        self._run_id = run_id
        record_run(run_dir, "mlflow", run_id, owner)

    def _reopen(self, run_id: str | None) -> str | None:
        """``run_id`` set running again, or None (with a warning) when the store no longer has it active."""
        if run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = self._client.get_run(run_id)
        except MlflowException as err:
            run = None
            reason = str(err).splitlines()[0]
        else:
            reason = f"it is {run.info.lifecycle_stage}"
        if run is None or run.info.lifecycle_stage != "active":
            warnings.warn(f"MLflow run {run_id} of tracking.json cannot continue ({reason}): a new run is opened",
                          stacklevel=3)
            return None
        self._client.update_run(run_id, status="RUNNING")
        return run_id

    def _create(self, settings: LoggingConfig, run_dir: Path, params: Mapping[str, Any]) -> str:
        from mlflow.entities import Param

        experiment = self._client.get_experiment_by_name(settings.project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(settings.project))
        run_id = self._client.create_run(experiment_id, run_name=_run_name(settings, run_dir)).info.run_id
        flat = [Param(k, v[:MLFLOW_MAX_PARAM_LENGTH]) for k, v in flatten_params(params).items()]
        for start in range(0, len(flat), MLFLOW_BATCH):
            self._client.log_batch(run_id, params=flat[start:start + MLFLOW_BATCH])
        return run_id

    def metric_name(self, key: str) -> str:
        """:func:`mlflow_metric_name`, made unique within the run (the first key keeps the plain name)."""
        if key not in self._names:
            name, taken, n = mlflow_metric_name(key), set(self._names.values()), 1
            unique = name
            while unique in taken:
                n += 1
                unique = f"{name[:MLFLOW_MAX_NAME_LENGTH - len(str(n)) - 1]}_{n}"
            self._names[key] = unique
        return self._names[key]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(self.metric_name(k), v, now, step) for k, v in metrics.items()]
        self._client.log_batch(self._run_id, metrics=batch)

    def close(self, failed: bool = False) -> None:
        if _closing(self):
            self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")


def _import_backend(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise ConfigError(f"logging.backends has {name!r}, but the {name} package is not installed "
                          f"(pip install 'megarlhf[tracking]')") from None


def open_trackers(settings: LoggingConfig, run_dir: str | Path, params: Mapping[str, Any],
                  resume_after_step: int) -> list:
    """The trackers ``settings.backends`` names, opened for ``run_dir`` (call on global rank 0 only);
    ``resume_after_step`` is the checkpoint's last completed step, -1 for a fresh start (which forgets
    the runs a former run in this directory recorded). ``params`` reach the backends redacted
    (:mod:`megarlhf.config.redact`)."""
    run_dir, params = Path(run_dir), redact(dict(params))
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume_after_step < 0:
        (run_dir / STATE_FILE).unlink(missing_ok=True)
    opened = []
    try:
        for name in settings.backends:
            opened.append(TRACKERS.get(name)(settings, run_dir, params, resume_after_step))
    except BaseException:
        close_trackers(opened, failed=True)
        raise
    _OPEN.extend(opened)
    return opened


def close_trackers(trackers, failed: bool = False) -> None:
    """Closes each tracker (``failed``: the run did not finish); one that fails to close (its server gone)
    is reported, the others still close."""
    for tracker in list(trackers):
        forget_tracker(tracker)
        try:
            tracker.close(failed=failed)
        except Exception as err:  # noqa: BLE001 - reported; the run's own files are complete
            warnings.warn(f"{type(tracker).__name__} could not close ({type(err).__name__}: {err})", stacklevel=2)


def forget_tracker(tracker) -> None:
    """Leaves a tracker the run has dropped (its backend failing) out of the close at exit."""
    if tracker in _OPEN:
        _OPEN.remove(tracker)


@atexit.register
def _close_failed_runs() -> None:
    """At interpreter exit, trackers still open belong to a run that ended without closing them."""
    close_trackers(list(_OPEN), failed=True)
