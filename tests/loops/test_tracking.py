"""megarlhf.records.tracking: the scalars and config a run logs to TensorBoard, W&B (offline) and MLflow (local
file store), read back from what each backend wrote, also after a resume; failures and absent packages.

W&B's offline run files are read with an independent reader of their record format (LevelDB's log
framing of protobuf ``Record`` messages), since wandb 0.31 ships no reader of its own.
"""
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import megarlhf
from megarlhf.config.train import LoggingConfig
from megarlhf.core.errors import ConfigError
from megarlhf.records.metrics import MetricsRecorder, read_metrics
from megarlhf.testing.launch import run_torchrun
from megarlhf.records.tracking import close_trackers, mlflow_metric_name, open_trackers, read_run_ids

CLI = Path(megarlhf.__file__).with_name("__main__.py")
BLOCK = 32768  # LevelDB log block; a record header is crc32 (4), length (2), type (1)


def read_wandb_history(run_dir: Path, run_id: str) -> tuple[list[dict], list[dict]]:
    """(history rows, config updates) of every offline W&B file of ``run_id`` under ``run_dir/wandb``,
    in the order written."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert files, f"no offline W&B run {run_id} under {run_dir}"
    history, config = [], []
    for path in files:
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, pending = 7, b""
        while pos + 7 <= len(data):
            if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
                pos += BLOCK - pos % BLOCK
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 and length == 0:
                break
            pending += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST: a whole record
                record = pb.Record()
                record.ParseFromString(pending)
                pending = b""
                which = record.WhichOneof("record_type")
                if which == "history":
                    history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                    for item in record.history.item})
                elif which in ("run", "config"):  # a run's initial config, or a later update
                    update = record.run.config.update if which == "run" else record.config.update
                    if update:
                        config.append({item.key: json.loads(item.value_json) for item in update})
    return history, config


def mlflow_store(monkeypatch, tmp_path) -> str:
    # MLflow 3 keeps its local file store in maintenance mode and refuses it unless asked
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file:{tmp_path / 'mlruns'}"


def last_value_per_step(points) -> dict[int, float]:
    """``{step: value}``, the value logged last at each step winning (a resumed run's)."""
    values = {}
    for step, value in points:
        values[step] = value
    return values


def test_trackers_log_config_and_scalars_and_a_resume_continues_their_runs(tmp_path, monkeypatch):
    import mlflow

    settings = LoggingConfig(run_dir=str(tmp_path), backends=["tensorboard", "wandb", "mlflow"],
                             project="tiny", run_name="trial", wandb_mode="offline",
                             mlflow_tracking_uri=mlflow_store(monkeypatch, tmp_path))
    # a config record over W&B's 32 KiB block: its reader joins the FIRST, MIDDLE and LAST chunks
    params = {"optim": {"lr": 1e-5, "betas": [0.9, 0.95]}, "seed": 3, "eval": {"path": None}, "notes": "n" * 70000}
    first = MetricsRecorder(tmp_path, total_steps=5, trackers=open_trackers(settings, tmp_path, params, -1),
                            resume_after_step=-1, stream=open("/dev/null", "w"))
    for step in range(4):  # the interrupted run logged steps 0-3; its checkpoint holds steps 0-1
        first.log(step, {"loss": 1.0 / (step + 1), "eval/pass@8": 0.5})
    first.close()
    ids = read_run_ids(tmp_path)
    assert set(ids) == {"wandb", "mlflow"}
    resumed = MetricsRecorder(tmp_path, total_steps=5, trackers=open_trackers(settings, tmp_path, params, 1),
                              resume_after_step=1, stream=open("/dev/null", "w"))
    for step in range(2, 5):
        resumed.log(step, {"loss": 10.0 + step, "eval/pass@8": 0.75})
    resumed.close()
    assert read_run_ids(tmp_path) == ids  # the resume reopened the same runs
    expected = {0: 1.0, 1: 0.5, 2: 12.0, 3: 13.0, 4: 14.0}

    history, config = read_wandb_history(tmp_path, ids["wandb"])
    assert last_value_per_step((row["step"], row["loss"]) for row in history) == expected
    assert last_value_per_step((row["step"], row["eval/pass@8"]) for row in history) == {
        0: 0.5, 1: 0.5, 2: 0.75, 3: 0.75, 4: 0.75}
    assert config[0]["optim"] == {"lr": 1e-5, "betas": [0.9, 0.95]} and config[0]["seed"] == 3
    assert config[0]["notes"] == "n" * 70000

    client = mlflow.MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
    run = client.get_run(ids["mlflow"])
    assert run.info.run_name == "trial" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    assert run.data.params == {"optim.lr": "1e-05", "optim.betas": "[0.9, 0.95]", "seed": "3", "eval.path": "null",
                               "notes": "n" * 6000}  # cut at MLflow's limit
    points = sorted(client.get_metric_history(ids["mlflow"], "loss"), key=lambda m: m.timestamp)
    assert last_value_per_step((m.step, m.value) for m in points) == expected
    assert {m.step for m in client.get_metric_history(ids["mlflow"], "eval/pass_at_8")} == set(range(5))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("loss")} == pytest.approx(expected)


def test_a_fresh_start_forgets_former_runs_and_purges_their_events(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = LoggingConfig(run_dir=str(tmp_path), backends=["tensorboard", "mlflow"],
                             mlflow_tracking_uri=mlflow_store(monkeypatch, tmp_path))
    for values in ([5.0, 6.0, 7.0], [1.0, 2.0]):  # a former run in this directory, then a fresh start
        recorder = MetricsRecorder(tmp_path, total_steps=3, trackers=open_trackers(settings, tmp_path, {}, -1),
                                   resume_after_step=-1, stream=open("/dev/null", "w"))
        for step, value in enumerate(values):
            recorder.log(step, {"x": value})
        recorder.close()
        if len(values) == 3:
            first = read_run_ids(tmp_path)["mlflow"]
    assert read_run_ids(tmp_path)["mlflow"] != first
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(0, 1.0), (1, 2.0)]
    # a fresh start naming fewer backends keeps no stale run for a later resume to append to
    for tracker in open_trackers(LoggingConfig(backends=[]), tmp_path, {}, -1):
        tracker.close()
    assert read_run_ids(tmp_path) == {}


def test_a_resume_opens_a_new_run_where_the_recorded_one_cannot_continue(tmp_path, monkeypatch):
    import mlflow

    uri = mlflow_store(monkeypatch, tmp_path)
    settings = LoggingConfig(backends=["mlflow"], project="a", mlflow_tracking_uri=uri)
    for tracker in open_trackers(settings, tmp_path, {}, -1):
        tracker.close()
    first = read_run_ids(tmp_path)["mlflow"]
    mlflow.MlflowClient(tracking_uri=uri).delete_run(first)
    with pytest.warns(UserWarning, match=f"MLflow run {first} of tracking.json cannot continue .*deleted"):
        for tracker in open_trackers(settings, tmp_path, {}, 3):
            tracker.close()
    second = read_run_ids(tmp_path)["mlflow"]
    assert second != first
    other_project = LoggingConfig(backends=["mlflow"], project="b", mlflow_tracking_uri=uri)
    with pytest.warns(UserWarning, match=f"the mlflow run {second} belongs to .*'experiment': 'a'"):
        for tracker in open_trackers(other_project, tmp_path, {}, 3):
            tracker.close()
    third = read_run_ids(tmp_path)["mlflow"]
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert third != second and client.get_experiment(client.get_run(third).info.experiment_id).name == "b"


def test_a_tracker_that_fails_to_log_is_dropped_and_training_goes_on(tmp_path):
    class Broken:
        calls = 0
        closes = []

        def log(self, step, metrics):
            Broken.calls += 1
            raise ConnectionError("server gone")

        def close(self, failed=False):
            Broken.closes.append(failed)
            raise ConnectionError("still gone")

    recorder = MetricsRecorder(tmp_path, total_steps=3, trackers=[Broken()], stream=open("/dev/null", "w"))
    with pytest.warns(UserWarning) as caught:
        for step in range(3):
            recorder.log(step, {"x": float(step)})
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and Broken.calls == 1  # not retried at every step
    assert all(part in messages[0] for part in ("Broken could not log step 0", "server gone", "closed as failed"))
    assert "Broken could not close" in messages[1] and "still gone" in messages[1]
    recorder.close()
    # closed once, as failed (an MLflow run is not left RUNNING), and not again by the recorder's close
    assert Broken.closes == [True] and [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    with pytest.warns(UserWarning, match="Broken could not close .*still gone"):
        close_trackers([Broken()])


FAILING_RUN = """
import sys
from megarlhf.config.schema import LoggingConfig
from megarlhf.records.tracking import open_trackers, close_trackers
settings = LoggingConfig(backends=["mlflow", "wandb"], project="p", wandb_mode="offline",
                         mlflow_tracking_uri=sys.argv[2])
trackers = open_trackers(settings, sys.argv[1], {}, -1)
if sys.argv[3] == "crash":
    raise RuntimeError("the trainer crashed")
if sys.argv[3] == "close_each":  # closed one by one by their owner, twice: the second close does nothing
    for tracker in trackers + trackers:
        tracker.close()
else:
    close_trackers(trackers)
"""


@pytest.mark.parametrize("ending, status", [("crash", "FAILED"), ("close", "FINISHED"), ("close_each", "FINISHED")])
def test_a_run_that_crashes_marks_its_tracker_runs_failed(tmp_path, monkeypatch, ending, status):
    import subprocess
    import sys

    import mlflow

    uri = mlflow_store(monkeypatch, tmp_path)
    script = tmp_path / "run.py"
    script.write_text(FAILING_RUN)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), uri, ending], capture_output=True,
                          text=True, timeout=300)
    assert (proc.returncode != 0) == (ending == "crash"), proc.stderr[-2000:]
    run_id = read_run_ids(tmp_path / "run")["mlflow"]
    assert mlflow.MlflowClient(tracking_uri=uri).get_run(run_id).info.status == status


def test_trackers_and_tracking_json_get_no_secrets(tmp_path, monkeypatch):
    import mlflow

    store = mlflow_store(monkeypatch, tmp_path)
    real_client = mlflow.MlflowClient
    monkeypatch.setattr(mlflow, "MlflowClient", lambda tracking_uri: real_client(tracking_uri=store))
    uri = "https://bob:hunter2@mlflow.example.com/?token=abc123&x=1"  # reaches the fake above only
    settings = LoggingConfig(backends=["wandb", "mlflow"], wandb_mode="offline", mlflow_tracking_uri=uri)
    params = {"reward": {"functions": [{"name": "judge", "kwargs": {"api_key": "sk-live-1", "max_new_tokens": 9}}]},
              "logging": {"mlflow_tracking_uri": uri}}
    recorder = MetricsRecorder(tmp_path, total_steps=1, trackers=open_trackers(settings, tmp_path, params, -1),
                               stream=open("/dev/null", "w"))
    recorder.log(0, {"x": 1.0})
    recorder.close()
    ids = read_run_ids(tmp_path)
    _, config = read_wandb_history(tmp_path, ids["wandb"])
    mlflow_params = real_client(tracking_uri=store).get_run(ids["mlflow"]).data.params
    written = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())
    for secret in ("hunter2", "sk-live-1", "abc123"):
        assert secret not in written and secret not in json.dumps(config) and secret not in json.dumps(mlflow_params)
    assert config[0]["reward"]["functions"][0]["kwargs"] == {"api_key": "<redacted>", "max_new_tokens": 9}
    expected_uri = "https://bob:<redacted>@mlflow.example.com/?token=<redacted>&x=1"
    assert mlflow_params["logging.mlflow_tracking_uri"] == expected_uri


def test_backends_are_checked_and_only_named_ones_imported(tmp_path, monkeypatch):
    from megarlhf.config.schema import ModelConfig, RunConfig
    from megarlhf.run.checks import check_config

    with pytest.raises(ConfigError, match=r"unknown tracking backend\(s\) \['comet'\]; known: mlflow, tensorboard"):
        check_config(RunConfig(model=ModelConfig(path="m"), logging=LoggingConfig(backends=["comet"])))
    with pytest.raises(ValueError, match="names a backend twice"):
        LoggingConfig(backends=["wandb", "wandb"])
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"has 'mlflow', but the mlflow package is not installed "
                                          r"\(pip install 'megarlhf\[tracking\]'\)"):
        open_trackers(LoggingConfig(backends=["mlflow"]), tmp_path, {}, -1)
    monkeypatch.undo()
    # with both installed, a TensorBoard run never imports mlflow (Megatron-Core's timers import wandb
    # whenever it is installed, so wandb is checked by making it unimportable: the run still starts)
    code = ("import sys; sys.modules['wandb'] = None;"
            "import megarlhf.loops.rl, megarlhf.loops.sft, megarlhf.loops.preference;"
            "from megarlhf.config.schema import LoggingConfig; from megarlhf.records.tracking import open_trackers;"
            f"[t.close() for t in open_trackers(LoggingConfig(backends=['tensorboard']), {str(tmp_path)!r}, {{}}, -1)];"
            "print('mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "False", out.stderr[-3000:]


def test_mlflow_names_and_missing_or_bad_tracking_uris(tmp_path, monkeypatch):
    from megarlhf.records.tracking import MlflowTracker

    assert mlflow_metric_name("eval/pass@8") == "eval/pass_at_8"
    assert mlflow_metric_name("reward/a*b (x): 1") == "reward/a_b _x_: 1"
    assert mlflow_metric_name("/a//b/./c/../d/") == "a/b/_/c/_/d" and len(mlflow_metric_name("x" * 300)) == 250
    tracker = MlflowTracker.__new__(MlflowTracker)
    tracker._names = {}
    assert [tracker.metric_name(k) for k in ("r/a*b", "r/a?b", "r/a_b", "r/a*b")] == ["r/a_b", "r/a_b_2", "r/a_b_3",
                                                                                   "r/a_b"]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="has mlflow but no tracking URI: set logging.mlflow_tracking_uri"):
        open_trackers(LoggingConfig(backends=["mlflow"]), tmp_path, {}, -1)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    settings = LoggingConfig(backends=["mlflow"], mlflow_tracking_uri=f"file:{tmp_path / 'mlruns'}")
    with pytest.raises(ConfigError, match="MLflow at tracking URI 'file:.*mlruns' cannot open the run"):
        open_trackers(settings, tmp_path, {}, -1)
    (tmp_path / "tracking.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tracking.json: not valid JSON"):
        read_run_ids(tmp_path)


def test_wandb_online_without_credentials_is_refused_before_any_prompt(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(ConfigError, match="no W&B credentials were found: run `wandb login`, set WANDB_API_KEY"):
        open_trackers(LoggingConfig(backends=["wandb"], wandb_mode="online"), tmp_path, {}, -1)


@pytest.mark.slow  # about 50 s: keeps the default suite under 15 minutes
def test_an_sft_run_and_its_resume_log_the_same_values_to_wandb_and_mlflow(rl_assets, tmp_path, monkeypatch):
    """Through the command line on 2 ranks: steps 0-1, then a resume to step 3; W&B and MLflow hold what
    metrics.jsonl holds, in one run each, with the resolved config as parameters."""
    import mlflow

    model, data = rl_assets
    uri = mlflow_store(monkeypatch, tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
model: {{path: {model}, dtype: float32}}
data: {{train_path: {data}/sft_train.jsonl, chat_template: never, max_sequence_length: 256}}
optim: {{lr: 1.0e-3}}
train: {{steps: 4, global_batch_size: 8, micro_batch_tokens: 512}}
checkpoint: {{every: 2}}
logging: {{run_dir: {tmp_path / 'run'}, backends: [wandb, mlflow], wandb_mode: offline,
           mlflow_tracking_uri: '{uri}', project: sft-trial}}
""")
    first = run_torchrun(CLI, 2, ["sft", str(recipe), "train.steps=2"], timeout_s=600)
    ids = read_run_ids(tmp_path / "run")
    run_torchrun(CLI, 2, ["sft", str(recipe), "checkpoint.resume=auto"], timeout_s=600)
    for notice in ("MCore's async save is deprecated", "full_param_layout not provided",  # quiet runs
                   "all_gather_into_tensor` is deprecated", "reduce_scatter_tensor` is deprecated",
                   "The .grad attribute of a Tensor that is not a leaf"):
        assert notice not in first.stdout + first.stderr
    assert read_run_ids(tmp_path / "run") == ids
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    expected = {r["step"]: r["sft/loss"] for r in records}

    history, config = read_wandb_history(tmp_path / "run", ids["wandb"])
    assert last_value_per_step((row["step"], row["sft/loss"]) for row in history) == expected
    assert config[0]["train"]["steps"] == 2 and config[0]["optim"]["lr"] == 1e-3
    assert any(update.get("train", {}).get("steps") == 4 for update in config[1:])  # the resume's config

    client = mlflow.MlflowClient(tracking_uri=uri)
    points = sorted(client.get_metric_history(ids["mlflow"], "sft/loss"), key=lambda m: m.timestamp)
    assert last_value_per_step((m.step, m.value) for m in points) == expected
    params = client.get_run(ids["mlflow"]).data.params
    assert params["optim.lr"] == "0.001" and params["model.path"] == str(model)
    assert params["logging.project"] == "sft-trial" and params["train.steps"] == "2"  # as the run began


def test_a_tracker_that_cannot_open_stops_every_rank_with_its_message(rl_assets, tmp_path, monkeypatch):
    """Rank 0 opens the trackers; the other ranks stop with its error instead of waiting in a collective."""
    model, data = rl_assets
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
model: {{path: {model}, dtype: float32}}
data: {{train_path: {data}/sft_train.jsonl, chat_template: never, max_sequence_length: 256}}
train: {{steps: 2, global_batch_size: 8, micro_batch_tokens: 512}}
logging: {{run_dir: {tmp_path / 'run'}, backends: [tensorboard, mlflow]}}
""")
    with pytest.raises(RuntimeError) as failed:
        run_torchrun(CLI, 2, ["sft", str(recipe)], timeout_s=300)
    message = str(failed.value)
    assert "has mlflow but no tracking URI" in message
    assert "rank 0 could not open the run's trackers: logging.backends has mlflow" in message
