"""Checkpoints, automatic resume and fast failure, with real msrun and 2 CPU workers."""

import json
import re
import shutil
import subprocess
import time

import pytest

from fmnist import tracking

from conftest import ROOT, job_env, read_summary, run_main, wait_for, write_dataset

pytestmark = pytest.mark.timeout(900)
EPOCHS = 3


@pytest.fixture(scope="module")
def longer_data(tmp_path_factory):
    """Enough samples that an epoch lasts seconds, so a worker can be killed in the middle of epoch 2."""
    directory = tmp_path_factory.mktemp("longer-data")
    write_dataset(directory, splits={"train": 4096, "t10k": 256})
    return directory


def job_args(data_dir, *extra):
    return ["--data-dir", str(data_dir), "--checksums-file", str(data_dir / "CHECKSUMS"),
            "--data-mirrors", "", "--output-dir", "out", "--epochs", str(EPOCHS), "--batch-size", "16",
            "--log-interval", "8", *extra]


def start_run_sh(cwd, args):
    return subprocess.Popen([str(ROOT / "run.sh"), *args], cwd=cwd, env=job_env(WORKERS="2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def killed_then_resumed(longer_data, tmp_path_factory):
    """A 2-worker job whose worker 1 is SIGKILLed during epoch 2, then the same command run again."""
    cwd = tmp_path_factory.mktemp("killed")
    logs = cwd / "out" / "logs"
    job = start_run_sh(cwd, job_args(longer_data))
    pid = int(wait_for(logs / "worker_1.log", r"rank 1 of 2 \(pid (\d+)\)", job).group(1))
    wait_for(logs / "worker_0.log", r"epoch 2/3 \| step 16/", job)
    killed_at = time.monotonic()
    subprocess.run(["kill", "-9", str(pid)], check=True)
    _, stderr = job.communicate(timeout=300)
    failed_after = time.monotonic() - killed_at
    first = {"status": job.returncode, "stderr": stderr, "failed_after": failed_after,
             "checkpoints": sorted(p.name for p in (cwd / "out" / "checkpoints").glob("*.ckpt"))}
    rerun = subprocess.run([str(ROOT / "run.sh"), *job_args(longer_data)], cwd=cwd, env=job_env(WORKERS="2"),
                           capture_output=True, text=True, timeout=600, check=False)
    return cwd, first, rerun


def test_killed_worker_ends_the_job_fast_and_run_sh_says_which(killed_then_resumed):
    _, first, _ = killed_then_resumed
    assert first["status"] == 137, first["stderr"][-3000:]  # the worker's own: 128 + SIGKILL
    assert first["failed_after"] < 20, first["failed_after"]  # msrun's scheduler, MS_NODE_TIMEOUT 5 s
    killed = r"worker_1\.log, process \d+ was killed by SIGKILL"
    assert re.search(killed, first["stderr"]), first["stderr"][-3000:]
    assert first["checkpoints"] == ["epoch-0001.ckpt"]  # epoch 2 never finished


def test_rerun_resumes_from_epoch_1_and_completes(killed_then_resumed):
    cwd, _, rerun = killed_then_resumed
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # A good run's console holds the job's own lines: none of MindSpore's INFO lines, which it logs at exit
    # whatever GLOG_v says (the worker's log keeps them).
    info = [line for line in rerun.stdout.splitlines() if line.startswith("[INFO] ")]
    assert not info, rerun.stdout[-3000:]
    worker0 = (cwd / "out" / "logs" / "worker_0.log").read_text()
    assert "resuming from out/checkpoints/epoch-0001.ckpt: 1 of 3 epochs done" in worker0
    assert "epoch 1/3 done" not in worker0  # epoch 1 was not trained again
    summary = read_summary(cwd / "out")
    assert summary["resumed_from_epoch"] == 1 and summary["replicas_identical"] is True
    assert [e["epoch"] for e in summary["epoch_history"]] == [1, 2, 3]
    assert sorted(p.name for p in (cwd / "out" / "checkpoints").glob("*.ckpt")) == [
        "epoch-0001.ckpt", "epoch-0002.ckpt", "epoch-0003.ckpt"]


def test_resumed_job_continues_its_mlflow_run_and_journal_holding_no_point_twice(killed_then_resumed):
    """msrun SIGKILLs rank 0, the journal's writer and sender, when worker 1 dies; the rerun continues the
    journal from its recorded position: every journaled point is in the run once, and every step's."""
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    cwd, _, _ = killed_then_resumed
    client = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fashion-mnist-lenet").experiment_id])
    assert [r.info.run_id for r in runs] == [read_summary(cwd / "out")["mlflow_run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["resumed"] == "true"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")] == [1, 2, 3]
    journal = [json.loads(line) for line in (cwd / "out" / tracking.JOURNAL).read_text().splitlines()]
    assert [op["op"] for op in journal].count("start") == 2
    journaled = sorted((op["step"], op["timestamp"], op["values"]["train_loss"]) for op in journal
                       if op["op"] == "metrics" and "train_loss" in op["values"])
    history = client.get_metric_history(run.info.run_id, "train_loss")
    held = sorted((m.step, m.timestamp, m.value) for m in history)
    # One point an interval, as an uninterrupted run has: the rerun trains the killed epoch's steps again, and
    # journals none of the killed job's points twice.
    assert held == journaled and [step for step, _, _ in held] == list(range(8, 3 * 4096 // 32 + 1, 8))


def test_exported_models_reproduce_the_jobs_accuracy(killed_then_resumed, longer_data):
    cwd, _, _ = killed_then_resumed
    summary = read_summary(cwd / "out")
    for model in ("model.ckpt", "model.mindir"):
        result = run_main(cwd, [*job_args(longer_data), "--predict", f"out/{model}"])
        assert result.returncode == 0, result.stderr[-3000:]
        accuracy = float(re.search(r"test accuracy (\d\.\d+)", result.stdout).group(1))
        assert accuracy == pytest.approx(summary["test_accuracy"], abs=1e-4), model


@pytest.fixture(scope="module")
def finished(tiny_data, tmp_path_factory):
    """One process trained 2 epochs of 16 steps on the defaults: the finished output directory each test below
    copies and reruns, and the run's console."""
    cwd = tmp_path_factory.mktemp("finished")
    result = run_main(cwd, on_defaults(tiny_data, "--epochs", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "out", result.stderr


def on_defaults(tiny_data, *extra):
    """The job on the tiny data in ./out, batches of 16, untracked, every other setting its default."""
    return ["--data-dir", str(tiny_data), "--checksums-file", str(tiny_data / "CHECKSUMS"),
            "--data-mirrors", "", "--output-dir", "out", "--batch-size", "16", "--tracking", "off", *extra]


def rerun(finished, tiny_data, tmp_path, *extra, damage=lambda out: None):
    """The finished output directory copied to tmp_path/out, `damage`d, and the same job run there with
    `extra`."""
    damage(shutil.copytree(finished[0], tmp_path / "out"))
    return run_main(tmp_path, on_defaults(tiny_data, *extra))


def test_resume_never_starts_fresh(finished, tiny_data, tmp_path):
    result = rerun(finished, tiny_data, tmp_path, "--epochs", "1", "--resume", "never")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming" not in result.stderr
    summary = read_summary(tmp_path / "out")
    assert (summary["resumed_from_epoch"], summary["epochs"]) == (0, 1)


def test_the_default_log_interval_fits_an_epoch_shorter_than_it(finished):
    """16 steps an epoch, under the default interval of 100: every epoch's end closes an interval."""
    _, console = finished
    progress = re.findall(r"epoch (\d)/2 \| step 16/16 \| loss \S+ \| \S+ samples/s \| epoch ends in 0 s, "
                          r"training in (\d+) s", console)
    assert [epoch for epoch, _ in progress] == ["1", "2"], console[-3000:]
    assert int(progress[1][1]) == 0
    assert re.search(r"epoch 1/2 done \| .* \| training ends in \d+ s", console)
    assert re.search(r"epoch 2/2 done \| .* \| training ends in 0 s", console)


def test_the_default_batch_size_fits_a_training_set_smaller_than_one_batch(tmp_path):
    """40 training images under the default batch of 64: the job trains on batches of 40, and says so; a batch
    size given is still refused (test_bad_input.py)."""
    small = tmp_path / "small"
    write_dataset(small, splits={"train": 40, "t10k": 16})
    result = run_main(tmp_path, ["--data-dir", str(small), "--checksums-file", str(small / "CHECKSUMS"),
                                 "--data-mirrors", "", "--output-dir", "out", "--epochs", "1",
                                 "--tracking", "off"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("--batch-size 64 (the default) with 1 worker(s) is more than the 40 training images: using 40"
            in result.stderr)
    assert read_summary(tmp_path / "out")["global_batch_size"] == 40


def test_a_finished_directory_rerun_with_fewer_epochs_reports_the_model_it_holds(finished, tiny_data,
                                                                                 tmp_path):
    trained = read_summary(finished[0])
    result = rerun(finished, tiny_data, tmp_path, "--epochs", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "holds a model of 2 epochs, more than --epochs 1" in result.stderr
    summary = read_summary(tmp_path / "out")
    assert summary["weights_sha256"] == trained["weights_sha256"]  # the same model, not trained again
    assert summary["epochs"] == 2 and len(summary["epoch_history"]) == 2
    # Measured again on the model written, and equal to what its own training measured.
    assert summary["test_accuracy"] == pytest.approx(trained["test_accuracy"], abs=1e-6)
    assert summary["test_loss"] == pytest.approx(trained["test_loss"], rel=1e-5)
    assert summary["test_samples"] == trained["test_samples"] == 96


def flip_a_bit(checkpoint):  # in the middle: the file is whole, its content is not
    flipped = bytearray(checkpoint.read_bytes())
    flipped[len(flipped) // 2] ^= 0x10
    checkpoint.write_bytes(flipped)


def truncate(checkpoint):  # as if its writer had died half-way
    checkpoint.write_bytes(checkpoint.read_bytes()[:5000])


@pytest.mark.parametrize("damage", [flip_a_bit, truncate])
def test_a_damaged_newest_checkpoint_is_skipped_and_a_rerun_keeps_only_the_newest(finished, tiny_data,
                                                                                  tmp_path, damage):
    """And the settings free to change on resume change: more epochs, another log interval, tracking."""
    result = rerun(finished, tiny_data, tmp_path, "--epochs", "4", "--keep-checkpoints", "2",
                   "--log-interval", "3", "--tracking", "offline",
                   damage=lambda out: damage(out / "checkpoints" / "epoch-0002.ckpt"))
    checkpoints = tmp_path / "out" / "checkpoints"
    assert result.returncode == 0, result.stderr[-3000:]
    # Every 3rd global step from the 16 of epoch 1: 18, the second of epoch 2.
    assert (tmp_path / "out" / tracking.JOURNAL).exists() and "epoch 2/4 | step 2/16 |" in result.stderr
    assert "skipping checkpoint out/checkpoints/epoch-0002.ckpt" in result.stderr
    assert "resuming from out/checkpoints/epoch-0001.ckpt: 1 of 4 epochs done" in result.stderr
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["epoch-0003.ckpt", "epoch-0004.ckpt"]
