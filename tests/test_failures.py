"""Failures that must end a job cleanly, through run.sh with 2 workers: a full volume wherever the job writes
(exit 4), a training that stopped learning (exit 3), a worker frozen by SIGSTOP (msrun's scheduler
ends the job, run.sh names it).
Real processes, real signals, real tmpfs volumes (the tests run as root)."""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import time

import pytest

from fmnist import common
from conftest import (ROOT, alive, job_env, no_traceback, read_summary, run_main, run_sh, serve, small_volume,
                      tiny_args, wait_for, worker_pids)

pytestmark = pytest.mark.timeout(600)


def mlflow_runs(cwd):
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    client = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}")
    return client, client.search_runs([client.get_experiment_by_name("fashion-mnist-lenet").experiment_id])


# --- replicas that differ


NUDGE_RANK_1 = """
import sys
sys.path.insert(0, {root!r})
import mindspore as ms
from fmnist import distributed

check = distributed.replicas_identical


def nudged(collective, net):  # one weight of rank 1 a little off, just before the job's own check
    if collective.rank == 1:
        weight = net.trainable_params()[0]
        weight.set_data(ms.Tensor(weight.asnumpy() + 1e-3))
    return check(collective, net)


distributed.replicas_identical = nudged
"""


def test_replicas_that_differ_end_the_job_with_exit_1_and_a_failed_run(tiny_data, tmp_path):
    """The real fingerprints, gather, report and exit path decide; a sitecustomize only moves one weight."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NUDGE_RANK_1.format(root=str(ROOT)))
    result = run_sh(tmp_path, tiny_args(tiny_data, "out"), WORKERS="2", PYTHONPATH=str(hook))
    assert result.returncode == 1, result.console[-3000:]
    assert "exited with status 1: the replicas' weights differ" in result.stderr, result.stderr[-3000:]
    worker0 = (tmp_path / "out" / "logs" / "worker_0.log").read_text()
    fingerprints = re.search(r"ERROR replicas diverged: weight fingerprints differ across ranks (\[\[.*\]\])",
                             worker0)
    assert fingerprints, worker0[-3000:]
    rows = json.loads(fingerprints.group(1))
    assert len(rows) == 2 and rows[0] != rows[1]
    summary = read_summary(tmp_path / "out")
    assert summary["replicas_identical"] is False and summary["weights_sha256"]
    _, runs = mlflow_runs(tmp_path)
    assert [run.info.status for run in runs] == ["FAILED"]
    assert no_traceback(result, tmp_path / "out" / "logs")


# --- a full volume


def test_full_volume_at_a_checkpoint_keeps_the_last_one_and_fails_the_run(tiny_data, tmp_path):
    """1,400 KB: two epoch checkpoints (540 KB each) fit, the third does not."""
    with small_volume(tmp_path / "volume", "1400k") as volume:
        args = tiny_args(tiny_data, volume, "--epochs", "4", "--keep-checkpoints", "5")
        result = run_sh(tmp_path, args, WORKERS="2", LOG_DIR=str(tmp_path / "logs"))
        assert result.returncode == common.EXIT_DISK_FULL, result.console[-3000:]
        full = (rf"no space left on the device of {volume}/checkpoints/epoch-0003\.ckpt "
                r"\(No space left on device\); free some space there")
        assert re.search(full, result.console), result.console[-3000:]
        assert "exited with status 4: a volume it writes to is full" in result.stderr
        assert no_traceback(result, tmp_path / "logs")
        assert sorted(p.name for p in volume.rglob("*") if p.is_file()) == [
            ".lock", "epoch-0001.ckpt", "epoch-0002.ckpt", "last-step", "mlflow-journal.jsonl",
            "mlflow-journal.position"]  # nothing half-written
        import mindspore as ms  # pylint: disable=import-outside-toplevel
        assert "meta" in ms.load_checkpoint(str(volume / "checkpoints" / "epoch-0002.ckpt"), crc_check=True)
    _, runs = mlflow_runs(tmp_path)
    assert [run.info.status for run in runs] == ["FAILED"]


def test_full_volume_at_the_final_model_writes_no_results(tiny_data, tmp_path):
    """800 KB: the grid, the epoch checkpoint and model.ckpt fit, model.mindir does not."""
    with small_volume(tmp_path / "volume", "800k") as volume:
        result = run_sh(tmp_path, tiny_args(tiny_data, volume, "--tracking", "off"), WORKERS="2",
                        LOG_DIR=str(tmp_path / "logs"))
        assert result.returncode == common.EXIT_DISK_FULL, result.console[-3000:]
        full = f"no space left on the device of {volume}/model.mindir"
        assert full in result.console, result.console[-3000:]
        assert no_traceback(result, tmp_path / "logs")
        assert not [p for p in volume.rglob("*") if ".part" in p.name]
        assert not (volume / "summary.json").exists()


def test_full_data_volume_stops_the_download(tiny_data, tmp_path):
    """100 KB for the data: the training images (140 KB gzipped) do not fit."""
    files = {p.name: p.read_bytes() for p in tiny_data.glob("*.gz")}
    with serve(files) as mirror, small_volume(tmp_path / "data", "100k") as volume:
        args = tiny_args(volume, "out", "--tracking", "off", "--checksums-file", str(tiny_data / "CHECKSUMS"),
                         "--data-mirrors", f"{mirror.url}/good")
        result = run_sh(tmp_path, args, WORKERS="2")
        assert result.returncode == common.EXIT_DISK_FULL, result.console[-3000:]
        assert f"no space left on the device of {volume}/train-images-idx3-ubyte" in result.console
        assert no_traceback(result, tmp_path / "out" / "logs")
        assert not [p for p in volume.iterdir() if p.name != ".lock"]  # no partial file


# --- a training that stopped learning


@pytest.mark.parametrize("lr, message", [
    ("50",
     r"training diverged: training loss [\d.e+]+ at step \d+ \(epoch 1\), over 10 times the 2\.30 of an "
           r"untrained network\. Start again with a lower --lr \(now 50\)"),
    ("1e-07",
     r"training diverged: not learning: after epoch 1 \(256 steps\) the validation accuracy is 0\.\d+ .* "
              r"against 0\.10 and 2\.30 for guessing\. Check --lr \(now 1e-07"),
], ids=["exploded", "never-learned"])
def test_a_training_that_stopped_learning_is_a_divergence(longer_data, tmp_path, lr, message):
    """Rank 0 also gets a SIGTERM as it marks the run FAILED, as a late signal would come (run.sh signals one
    worker after another; a cluster, each node's pod in its own time): it changes nothing."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, signal, sys\n"
        "if sys.argv[0].endswith('main.py'):\n"
        "    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))\n"
        "    from fmnist import tracking\n"
        "    real = tracking.Tracker.finish\n"
        "    def finish(self, *args, **kwargs):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        return real(self, *args, **kwargs)\n"
        "    tracking.Tracker.finish = finish\n")
    args = tiny_args(longer_data, "out", "--lr", lr, "--epochs", "3", "--log-interval", "8",
                     "--register-model", "m")
    result = run_sh(tmp_path, args, WORKERS="2", PYTHONPATH=str(hook))
    assert result.returncode == common.EXIT_DIVERGED, result.console[-3000:]
    assert re.search(message, result.console), result.console[-3000:]
    assert no_traceback(result, tmp_path / "out" / "logs")
    # Every rank stops on the same gathered figures, at the same step: rank 1 names the same reason.
    reason = re.search(r"training diverged: (.+?)\. (?:Start|Check) ", result.console).group(1)
    worker1 = (tmp_path / "out" / "logs" / "worker_1.log").read_text()
    assert f"rank 1 stops with the others: {reason}" in worker1
    for name in ("summary.json", "model.ckpt", "model.mindir"):
        assert not (tmp_path / "out" / name).exists(), name
    client, runs = mlflow_runs(tmp_path)
    assert [run.info.status for run in runs] == ["FAILED"] and client.search_registered_models() == []


# From the 41st log interval on (epoch 2, at 32 intervals an epoch), the gathered training loss is NaN.
NAN_IN_EPOCH_2 = """
import os, sys
if sys.argv[0].endswith("main.py"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    import numpy as np
    from fmnist import distributed
    gather, intervals = distributed.Collective.all_gather, []
    def all_gather(self, array):
        rows = gather(self, array)
        if rows.dtype == np.float64 and rows.shape[1:] == (2,):  # an interval's (loss, stop request)
            intervals.append(1)
            if len(intervals) > 40:
                rows[:, 0] = np.nan
        return rows
    distributed.Collective.all_gather = all_gather
"""


def test_a_divergence_keeps_the_checkpoints_of_the_good_epochs(longer_data, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NAN_IN_EPOCH_2)
    args = tiny_args(longer_data, "out", "--epochs", "3", "--log-interval", "8", "--tracking", "off")
    result = run_sh(tmp_path, args, WORKERS="2", PYTHONPATH=str(hook))
    assert result.returncode == common.EXIT_DIVERGED, result.console[-3000:]
    assert "training loss nan at step 328 (epoch 2)" in result.console, result.console[-3000:]
    assert "the checkpoints of the good epochs stay in out/checkpoints" in result.console
    checkpoints = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["epoch-0001.ckpt"]
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    meta = json.loads(ms.load_checkpoint(str(checkpoints / "epoch-0001.ckpt"), crc_check=True)["meta"])
    assert meta["steps"] == 256 and len(meta["history"]) == 1
    assert not (tmp_path / "out" / "model.ckpt").exists() and not (tmp_path / "out" / "summary.json").exists()


def test_divergence_check_off_trains_on(longer_data, tmp_path):
    """The flag alone decides: one process, 256 steps of 32 images, as the 2 workers above take."""
    result = run_main(tmp_path,
                      tiny_args(longer_data, "out", "--lr", "1e-07", "--tracking", "off", "--log-interval",
                                          "8", "--divergence-check", "off", "--batch-size", "32"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "out")
    # What the check stops: no better than guessing after 256 steps.
    at_chance = summary["test_accuracy"] <= 0.12 or summary["test_loss"] >= 0.98 * math.log(10)
    assert at_chance, summary["epoch_history"]
    assert summary["epoch_history"] and "diverged" not in result.stderr


# --- a frozen worker


def test_a_frozen_worker_ends_the_job_and_is_named(longer_data, tmp_path):
    args = tiny_args(longer_data, "out", "--tracking", "off", "--epochs", "20", "--log-interval", "8")
    job = subprocess.Popen([str(ROOT / "run.sh"), *args],
                           cwd=tmp_path, env=job_env(WORKERS="2"), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    logs = tmp_path / "out" / "logs"
    try:
        wait_for(logs / "worker_0.log", r"epoch 1/20 \| step 16/", job)
        workers = worker_pids(logs)
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = job.communicate(timeout=120)
        ended_after = time.monotonic() - stopped
        outlived = [pid for pid in workers if alive(pid)]  # before the clean-up below ends them anyway
    finally:
        if job.poll() is None:
            job.kill()
        for pid in worker_pids(logs):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert "rank 1 stopped answering for 5 s (frozen, stopped, or its node lost)" in stderr, stderr[-3000:]
    # MS_NODE_TIMEOUT (5 s, run.sh) and a heartbeat a second: about 11 s here; msrun's default took 40.
    assert ended_after < 30, ended_after
    assert outlived == []
