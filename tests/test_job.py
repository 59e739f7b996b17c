"""The real job end to end: msrun with 2 CPU workers, and a lone process, on tiny generated data."""

import math

import pytest

from conftest import read_summary, run_main, run_msrun, serve, tiny_args

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def two_worker_run(tiny_data, tmp_path_factory):
    """One 2-worker msrun job shared by the checks: it downloads the tiny dataset from a loopback mirror
    into an empty data dir and tracks to MLflow's embedded default store (no server)."""
    cwd = tmp_path_factory.mktemp("job")
    files = {p.name: p.read_bytes() for p in tiny_data.glob("*.gz")}
    with serve(files) as mirror:
        args = tiny_args(cwd / "data", cwd / "out", "--checksums-file", str(tiny_data / "CHECKSUMS"),
                         "--data-mirrors", f"{mirror.url}/good", "--run-name", "e2e")
        result = run_msrun(cwd, args)
    return cwd, result, mirror


def test_data_is_downloaded_once_per_job_not_per_rank(two_worker_run):
    cwd, result, mirror = two_worker_run
    assert result.returncode == 0, result.logs
    assert sorted(mirror.requests.values()) == [1, 1, 1, 1]
    assert sorted(p.name for p in (cwd / "data").glob("*.gz")) == sorted(mirror.files)


def test_msrun_job_exits_zero_with_identical_replicas(two_worker_run):
    cwd, result, _ = two_worker_run
    assert result.returncode == 0, result.logs
    summary = read_summary(cwd / "out")
    assert summary["replicas_identical"] is True
    assert (summary["world_size"], summary["device"], summary["epochs"]) == (2, "CPU", 1)
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and math.isfinite(summary["test_loss"])
    for key in ("train_samples_per_s", "wall_s", "first_step_s"):
        assert summary[key] > 0, key


def test_progress_lines_come_from_rank_0_only(two_worker_run):
    _, result, _ = two_worker_run
    assert "rank0 INFO epoch 1/1 | step 2/8 | loss " in result.logs["worker_0.log"]
    assert "samples/s" not in result.logs["worker_1.log"]


def test_sample_grid_is_a_png(two_worker_run):
    cwd, _, _ = two_worker_run
    png = (cwd / "out" / "samples.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


def test_mlflow_embedded_store_holds_one_run_for_the_job(two_worker_run):
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    cwd, _, _ = two_worker_run
    summary = read_summary(cwd / "out")
    client = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fashion-mnist-lenet")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [summary["mlflow_run_id"]]  # one run, not one per rank
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "e2e"
    assert run.data.params["world_size"] == "2" and run.data.params["lr"] == "0.1"
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert [m.value for m in history] == [pytest.approx(summary["test_accuracy"])]
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 4  # steps 2, 4, 6, 8
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"samples.png", "summary.json"} <= artifacts


def test_single_process_without_msrun(tiny_data, tmp_path):
    result = run_main(tmp_path, tiny_args(tiny_data, tmp_path / "out", "--tracking", "off"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "out")
    assert summary["world_size"] == 1 and summary["replicas_identical"] is True
    assert summary["mlflow_run_id"] is None and not (tmp_path / "mlflow.db").exists()


def test_learns_the_tiny_task(tiny_data, tmp_path):
    """Ten short epochs on data whose class is a bright band: far above the 0.1 of guessing."""
    result = run_main(tmp_path, tiny_args(tiny_data, tmp_path / "out", "--tracking", "off", "--epochs", "10"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(tmp_path / "out")["test_accuracy"] >= 0.5
