"""MLflow tracking against a real `mlflow server` on 127.0.0.1: what a 2-worker job records, and outages."""

import contextlib
import logging
import subprocess
import sys
import time
import urllib.request

import pytest

import main
from conftest import ROOT, free_port, job_env, read_summary, run_main, run_msrun, tiny_args

pytestmark = pytest.mark.timeout(600)
EPOCHS = 2


@contextlib.contextmanager
def mlflow_server(directory):
    """A real tracking server with its own SQLite store and proxied artifact store, stopped afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{directory / 'server.db'}",
           "--artifacts-destination", str(directory / "artifacts"), "--workers", "1"]
    log_file = open(directory / "server.log", "wb")  # pylint: disable=consider-using-with
    server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=directory)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(directory / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url, server
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log_file.close()


@pytest.fixture(scope="module")
def tracked_job(tiny_data, tmp_path_factory):
    """A 2-worker job logging to a live server; yields the server URL, the job's output dir and result."""
    directory = tmp_path_factory.mktemp("tracked")
    with mlflow_server(directory) as (url, _):
        env = job_env(MLFLOW_TRACKING_URI=url, MLFLOW_EXPERIMENT_NAME="tracked")
        result = run_msrun(directory, tiny_args(tiny_data, directory / "out", "--epochs", str(EPOCHS)), env=env)
        yield url, directory, result


@pytest.fixture(scope="module")
def tracked_run(tracked_job):
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    url, directory, result = tracked_job
    assert result.returncode == 0, result.logs
    client = MlflowClient(tracking_uri=url)
    return client, client.get_run(read_summary(directory / "out")["mlflow_run_id"]), read_summary(directory / "out")


def test_one_run_with_the_jobs_parameters_and_tags(tracked_run):
    client, run, _ = tracked_run
    experiment = client.get_experiment_by_name("tracked")
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert (params["world_size"], params["device"], params["amp_level"], params["seed"]) == ("2", "CPU", "O0", "42")
    assert params["mindspore_version"] and params["job_version"] == main.JOB_VERSION
    assert params["global_batch_size"] == "32" and params["batch_size"] == "16"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    if commit.returncode == 0:
        assert run.data.tags["git_commit"] == commit.stdout.strip()
    assert (run.data.tags["device"], run.data.tags["world_size"]) == ("CPU", "2")


def test_training_loss_is_the_mean_over_ranks(tracked_run):
    client, run, _ = tracked_run
    history = {key: client.get_metric_history(run.info.run_id, key)
               for key in ("train_loss", "train_loss_rank0", "train_loss_rank1")}
    assert [m.step for m in history["train_loss"]] == list(range(2, 8 * EPOCHS + 1, 2))  # 8 steps an epoch
    for mean, r0, r1 in zip(*history.values()):
        assert mean.value == pytest.approx((r0.value + r1.value) / 2)
    assert any(r0.value != r1.value for r0, r1 in zip(history["train_loss_rank0"], history["train_loss_rank1"]))


def test_per_epoch_figures_match_the_summary(tracked_run):
    client, run, summary = tracked_run
    for key in ("val_accuracy", "val_loss", "epoch_train_samples_per_s", "epoch_eval_s"):
        values = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in values] == list(range(1, EPOCHS + 1)), key
    accuracy = [m.value for m in client.get_metric_history(run.info.run_id, "val_accuracy")]
    assert accuracy == pytest.approx([e["val_accuracy"] for e in summary["epoch_history"]])
    assert run.data.metrics["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert run.data.metrics["wall_s"] > 0


def test_artifacts_are_on_the_run(tracked_run, tracked_job):
    client, run, _ = tracked_run
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert names == {"samples.png", "training_curves.png", "confusion_matrix.png", "model.ckpt", "model.mindir",
                     "summary.json"}
    _, directory, _ = tracked_job
    local = client.download_artifacts(run.info.run_id, "summary.json", str(directory))
    assert read_summary(local.rsplit("/", 1)[0])["mlflow_run_id"] == run.info.run_id


def test_dead_server_at_start_costs_seconds_not_minutes(tiny_data, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = run_main(tmp_path, tiny_args(tiny_data, tmp_path / "out"), env=job_env(MLFLOW_TRACKING_URI=dead))
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MLflow: tracking is off for the rest of the job" in result.stderr
    assert "MLflow: not logged:" in result.stderr
    summary = read_summary(tmp_path / "out")
    assert summary["mlflow_run_id"] is None and summary["replicas_identical"] is True
    assert elapsed < 90, elapsed  # MLflow's defaults would retry for minutes


def test_server_lost_mid_run_ends_tracking_with_a_warning(tmp_path, caplog):
    """The tracker on its own against a server that is stopped while metrics are being logged."""
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    with mlflow_server(tmp_path) as (url, server):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MLFLOW_TRACKING_URI", url)
            tracker = main.MlflowTracker("mid-run", "lost", {"lr": 0.1}, {"device": "CPU"}, finish_timeout=60)
            tracker.log_metrics({"train_loss": 1.0}, step=1)
            run_id = tracker.run_id
            assert run_id
            deadline = time.monotonic() + 30
            while not MlflowClient(url).get_metric_history(run_id, "train_loss") and time.monotonic() < deadline:
                time.sleep(0.2)
            server.terminate()
            server.wait(timeout=20)
            with caplog.at_level(logging.WARNING, logger="fashion-mnist"):
                tracker.log_metrics({"train_loss": 0.5, "val_accuracy": 0.9}, step=2)
                started = time.monotonic()
                tracker.finish("FINISHED")
                assert time.monotonic() - started < 60
    messages = [r.getMessage() for r in caplog.records]
    assert any("tracking is off for the rest of the job" in m for m in messages), messages
    assert any("not logged: 2 metric values" in m for m in messages), messages
