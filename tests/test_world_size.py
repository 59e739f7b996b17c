"""The same training on any number of workers, on the real data with the defaults and through run.sh: 1 and 2
workers with one global batch train alike, and a training stopped on one world size ends on the other, in the
same MLflow run (docs/data-order.md)."""

import dataclasses
import re
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from fmnist import data
from conftest import ROOT, job_env, read_summary, run_sh, wait_for

pytestmark = pytest.mark.timeout(900)
# Measured on an Intel Xeon (Sapphire Rapids), 2 cores (docs/data-order.md): the losses of the first 60 steps
# differ by at most 6e-8, the mean loss of the first 100 by 0.003, the test accuracy after 3 epochs by 0.0004.
SAME_STEPS, STEP_LOSS, FIRST_100_LOSS, ACCURACY = 60, 1e-5, 0.01, 0.003
# Inside the last epoch, where the job gets its SIGTERM: the resumes on the other world size train its last
# third.
STOP = r"epoch 3/3 \| step 2\d\d/"
LOCAL_COPIES = (*data.SYSTEM_DIRS, ROOT.parent / "shared" / "data" / "fashion-mnist")


@pytest.fixture(scope="module")
def real_data(tmp_path_factory):
    """Fashion-MNIST from a local copy (make test installs Debian's), linked into a directory of its own."""
    names = [f"{name}.gz" for split in data.FILES.values() for name in split]
    source = next((Path(d) for d in LOCAL_COPIES if (Path(d) / names[0]).exists()), None)
    if source is None:
        pytest.skip(f"no local copy of Fashion-MNIST in {', '.join(map(str, LOCAL_COPIES))}")
    directory = tmp_path_factory.mktemp("fashion-mnist")
    for name in names:
        (directory / name).symlink_to(source / name)
    return directory


def job_args(real_data, *extra):
    return ["--data-dir", str(real_data), "--data-mirrors", "", "--epochs", "3", "--log-interval", "10",
            *extra]


def per_device(workers):
    """1 worker is given the global batch, 128, at its start; 2 take the default 64 each."""
    return ("--batch-size", "128") if workers == 1 else ()


def mlflow_run(cwd, run_id):
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    return client, client.get_run(run_id)


def first_100_losses(cwd):
    summary = read_summary(cwd / "outputs")
    client, _ = mlflow_run(cwd, summary["mlflow_run_id"])
    history = client.get_metric_history(summary["mlflow_run_id"], "train_loss")
    return np.array([metric.value for metric in sorted(history, key=lambda metric: metric.step)
                     if metric.step <= 100])


@dataclasses.dataclass(frozen=True)
class Stopped:
    directory: Path  # to resume on the same world size
    copy: Path  # to resume on the other
    step: int


@pytest.fixture(scope="module")
def stopped(real_data, tmp_path_factory):
    """For 1 and 2 workers of global batch 128, a training stopped by SIGTERM inside epoch 3, and a copy of
    its directory (checkpoints, logs, MLflow store), so that it is resumed twice: on each world size. The
    copy's store keeps the original's artifact location, so both resumes log artifacts there; these tests
    read the stores' metrics and the summaries."""
    runs = {}
    for workers in (2, 1):
        directory = tmp_path_factory.mktemp(f"{workers}-workers")
        job = subprocess.Popen([str(ROOT / "run.sh"), *job_args(real_data, *per_device(workers))],
                               cwd=directory, env=job_env(WORKERS=str(workers)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log = directory / "outputs" / "logs" / "worker_0.log"
        wait_for(log, STOP, job, timeout=600)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        step = int(re.search(r"stopped by SIGTERM at step (\d+)", log.read_text()).group(1))
        copy = tmp_path_factory.mktemp(f"{workers}-to-{3 - workers}")
        shutil.copytree(directory, copy, dirs_exist_ok=True)
        runs[workers] = Stopped(directory, copy, step)
    return runs


@pytest.fixture(scope="module")
def straight(stopped, real_data):
    """Each stopped training resumed on its own world size: an exact resume, bit-identical to the training
    never stopped (tests/test_preemption.py), so these are 1 and 2 workers training unbroken."""
    for workers, run in stopped.items():
        result = run_sh(run.directory, job_args(real_data, *per_device(workers)), timeout=600,
                        WORKERS=str(workers))
        assert result.returncode == 0, result.console[-3000:]
    return {workers: run.directory for workers, run in stopped.items()}


def test_one_and_two_workers_with_one_global_batch_train_the_same_model(straight):
    one, two = (read_summary(straight[workers] / "outputs") for workers in (1, 2))
    shapes = [(summary["world_size"], summary["global_batch_size"]) for summary in (one, two)]
    assert shapes == [(1, 128), (2, 128)]
    losses = {workers: first_100_losses(cwd) for workers, cwd in straight.items()}
    # Every 10 steps, the mean loss of those 10: float rounding alone at first, then amplified as the network
    # leaves the plateau of an untrained one (about step 75).
    same = np.abs(losses[1] - losses[2])[:SAME_STEPS // 10]
    assert same.max() <= STEP_LOSS, same
    assert abs(losses[1].mean() - losses[2].mean()) <= FIRST_100_LOSS
    accuracies = one["test_accuracy"], two["test_accuracy"]
    assert abs(accuracies[0] - accuracies[1]) <= ACCURACY, accuracies


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_a_training_stopped_on_one_world_size_ends_on_another_in_the_same_run(stopped, straight, real_data,
                                                                               before, after):
    """The copy of the training stopped on `before` workers, resumed by the same command on `after`: a resume
    keeps the global batch whatever --batch-size says."""
    directory, stopped_at = stopped[before].copy, stopped[before].step
    resumed = run_sh(directory, job_args(real_data), timeout=600, WORKERS=str(after))
    assert resumed.returncode == 0, resumed.console[-3000:]
    was, now = 128 // before, 128 // after
    plural = "s" if after > 1 else ""
    log = directory / "outputs" / "logs" / "worker_0.log"
    assert (f"resuming a {before}-worker training on {after} worker{plural}: {was} -> {now} per device, "
            "global batch 128 kept") in log.read_text()
    summary = read_summary(directory / "outputs")
    assert summary["epochs"] == 3 and summary["global_batch_size"] == 128 and summary["restarts"] == 1
    # The second part starts at the very step the first was stopped at and checkpointed: none twice or lost.
    assert summary["parts"] == [{"first_step": 0, "world_size": before, "batch_size": was},
                                {"first_step": stopped_at, "world_size": after, "batch_size": now}]
    assert 2 * 468 < stopped_at < 3 * 468
    expected = read_summary(straight[2] / "outputs")["test_accuracy"]
    assert abs(summary["test_accuracy"] - expected) <= ACCURACY, (summary["test_accuracy"], expected)
    client, run = mlflow_run(directory, summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["resumed"] == "true"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # one run for the whole training
    world_sizes = client.get_metric_history(run.info.run_id, "world_size")
    assert sorted((m.step, m.value) for m in world_sizes) == [(1, before), (stopped_at + 1, after)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "restarts")] == [stopped_at + 1]
