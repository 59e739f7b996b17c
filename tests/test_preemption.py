"""Preemption without lost work, with real msrun and 2 CPU workers: step checkpoints, the checkpoint at a
SIGTERM stop (run.sh as PID 1, as in a pod: every rank stops at one step, within the grace period, and the
run is KILLED), a resume from the middle of an epoch that ends bit-identical to a training never
interrupted, and each restart's cost in the same MLflow run."""

import re
import signal
import subprocess
import time

import psutil
import pytest

from conftest import ROOT, job_env, read_summary, wait_for

pytestmark = pytest.mark.timeout(900)
EVERY = 10  # --checkpoint-steps


def job_args(data_dir, *extra):
    return ["--data-dir", str(data_dir), "--checksums-file", str(data_dir / "CHECKSUMS"),
            "--data-mirrors", "", "--output-dir", "out", "--epochs", "2", "--batch-size", "16",
            "--log-interval", "8", "--checkpoint-steps", str(EVERY), *extra]


def start(cwd, args):
    """run.sh with 2 workers, as the image starts the job, in a PID namespace of its own so that a kill -9
    of its first process takes every process of the job with it, as losing the pod would. Its console goes
    to cwd/console.log; returns the process and the log that rank 0 writes."""
    job = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                            str(ROOT / "run.sh"), *args],
                           cwd=cwd, env=job_env(WORKERS="2", MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1"),
                           stdout=subprocess.DEVNULL, stderr=(cwd / "console.log").open("w"))
    return job, cwd / "out" / "logs" / "worker_0.log"


def run(cwd, args):
    job, log = start(cwd, args)
    assert job.wait(timeout=600) == 0, (cwd / "console.log").read_text()[-3000:]
    return read_summary(cwd / "out"), log.read_text()


@pytest.fixture(scope="module")
def uninterrupted(longer_data, tmp_path_factory):
    """The weights' fingerprint of the same training never interrupted."""
    return run(tmp_path_factory.mktemp("whole"),
               job_args(longer_data, "--tracking", "off"))[0]["weights_sha256"]


# One process stops by the same code as rank 0 (the StopRequest, then stop_early): the 2-worker runs cover it.
@pytest.mark.parametrize("how", ["sigterm", "kill"], ids=["sigterm", "kill-9"])
def test_an_interrupted_training_resumes_mid_epoch_bit_identical_and_logs_the_cost(longer_data, tmp_path,
                                                                                    uninterrupted, how):
    args = job_args(longer_data)
    job, log = start(tmp_path, args)
    wait_for(log, r"epoch 2/2 \| step (40|48)/", job, timeout=300)
    signalled, processes = time.monotonic(), psutil.Process(job.pid).children(recursive=True)
    if how == "kill":
        job.kill()  # with 2 workers, unshare's PID namespace goes, and every process of the job with it
    else:  # to run.sh, as Kubernetes would signal its PID 1
        psutil.Process(job.pid).children()[0].send_signal(signal.SIGTERM)
    status = job.wait(timeout=120)
    stopped_at, stopped_after = time.time(), time.monotonic() - signalled  # after the stopped job's last step
    # unshare can end before the job's processes, and one could still write.
    psutil.wait_procs(processes, timeout=60)
    stopped_log = log.read_text()
    assert not (tmp_path / "out" / "summary.json").exists()
    last_step = int((tmp_path / "out" / "checkpoints" / "last-step").read_text().split()[0])
    checkpoints = sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("*.ckpt"))
    assert len(checkpoints) <= 3, checkpoints  # --keep-checkpoints
    step_in_epoch = int(re.fullmatch(r"epoch-0002-step-(\d{6})\.ckpt", checkpoints[-1]).group(1))
    resumed_step = 8192 // (16 * 2) + step_in_epoch  # the global step of the checkpoint resumed from
    if how == "sigterm":
        assert status == 143, stopped_log[-3000:]
        # The ranks agree at a log interval (8 steps), and rank 0 checkpoints that very step: nothing is lost.
        assert step_in_epoch % 8 == 0 and last_step == resumed_step, (checkpoints, last_step)
        written = f"checkpoint out/checkpoints/{checkpoints[-1]} written, the next start resumes from it"
        assert written in stopped_log
        assert stopped_after < 30, stopped_after  # Kubernetes' default grace period
        # Rank 1 ended on its own at rank 0's step: as PID 1's exit the kernel would have killed it.
        stop = re.search(r"stopped by SIGTERM at step (\d+)", stopped_log).group(1)
        worker1 = (tmp_path / "out" / "logs" / "worker_1.log").read_text()
        assert f"rank 1 stops with the others: stopped by SIGTERM at step {stop}" in worker1, worker1[-2000:]
    else:
        assert status in (-signal.SIGKILL, 128 + signal.SIGKILL), stopped_log[-3000:]
        assert resumed_step % EVERY == 0, checkpoints
        # At most one checkpoint's interval lost, and the one the writer had in flight.
        assert 0 <= last_step - resumed_step < 2 * EVERY, (checkpoints, last_step)

    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    stopped_run_id = re.search(r"MLflow: run (\w+)", stopped_log).group(1)
    if how == "sigterm":  # a kill -9 leaves no word
        assert client.get_run(stopped_run_id).info.status == "KILLED"

    time.sleep(2)  # a gap the restart's cost must include
    rerun_at = time.time()
    summary, resumed_log = run(tmp_path, args)
    assert summary["weights_sha256"] == uninterrupted
    assert (summary["resumed_from_epoch"], summary["resumed_from_step"],
            summary["restarts"]) == (1, step_in_epoch, 1)
    assert (f"resuming from out/checkpoints/{checkpoints[-1]}: 1 of 2 epochs and {step_in_epoch} steps done"
            in resumed_log)
    assert [e["epoch"] for e in summary["epoch_history"]] == [1, 2]

    run_id = summary["mlflow_run_id"]
    # The same run, continued.
    assert run_id == stopped_run_id and client.get_run(run_id).info.status == "FINISHED"
    metrics = client.get_run(run_id).data.metrics
    assert metrics["restarts"] == 1 and metrics["restart_steps_lost"] == last_step - resumed_step
    cost = re.search(r"restart 1: (\d+) steps lost, ([\d.]+) s from the stop to this step", resumed_log)
    assert cost and int(cost.group(1)) == last_step - resumed_step, resumed_log[-3000:]
    # From the stopped job's last step to the first new step: at least the gap between the stop and the rerun.
    assert metrics["restart_total_s"] >= rerun_at - stopped_at >= 2
    assert [m.step for m in client.get_metric_history(run_id, "restarts")] == [resumed_step + 1]
    # Each interval's loss once: the stop's own included after a SIGTERM, and after a kill -9 not again for
    # the steps trained twice. The system metrics' samples go on from the stopped job's.
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train_loss"))
    assert steps == list(range(8, 2 * 256 + 1, 8)), steps
    cpu = client.get_metric_history(run_id, "system/node0/cpu_utilization_percentage")
    samples = sorted(m.step for m in cpu)
    assert samples == list(range(len(samples))) and len(samples) > 2, samples
