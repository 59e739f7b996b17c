"""Real operations: resumes that must not mix settings, one job per output dir, Ctrl-C (run.sh under
a shell), and two msrun nodes in two network namespaces. Real processes and real signals."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from fmnist import checkpoints, common
from conftest import (ROOT, alive, job_env, job_processes, kill_all, mlflow_server, read_summary, run_main,
                      run_msrun, run_sh, runs_main_py, tiny_args, wait_for, worker_pids)

pytestmark = pytest.mark.timeout(900)


def job_args(data_dir, output_dir, *extra):
    return ["--data-dir", str(data_dir), "--checksums-file", str(data_dir / "CHECKSUMS"),
            "--data-mirrors", "", "--output-dir", str(output_dir), "--batch-size", "16",
            "--log-interval", "8", *extra]


def mlflow_run(cwd, run_id):
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    return MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}").get_run(run_id)


# --- resume


def test_resume_refuses_other_settings_but_not_another_world_size(tiny_data, tmp_path):
    first = run_msrun(tmp_path, tiny_args(tiny_data, tmp_path / "out", "--tracking", "off"))
    assert first.returncode == 0, first.logs
    changed = run_main(tmp_path, tiny_args(tiny_data, tmp_path / "out", "--tracking", "off", "--epochs", "2",
                                           "--lr", "0.01", "--optimizer", "momentum"))
    assert changed.returncode == common.EXIT_USAGE
    error = [line for line in changed.stderr.splitlines() if "ERROR" in line]
    assert len(error) == 1, changed.stderr[-3000:]
    for difference in ("lr: was 0.1, now 0.01", "optimizer: was sgd, now momentum", "--resume never"):
        assert difference in error[0], (difference, error[0])
    # The world size is free (the global batch is kept), and so is the per-device batch it implies.
    assert "world_size" not in error[0] and "global_batch" not in error[0], error[0]
    assert not (tmp_path / "out" / "checkpoints" / "epoch-0002.ckpt").exists()


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_naming_those_that_do(tiny_data,
                                                                                            tmp_path):
    first = run_main(tmp_path,
                     tiny_args(tiny_data, tmp_path / "out", "--tracking", "off", "--batch-size", "3"))
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_sh(tmp_path, tiny_args(tiny_data, tmp_path / "out", "--tracking", "off", "--epochs", "2"),
                     WORKERS="2")
    assert resumed.returncode == common.EXIT_USAGE, resumed.console[-3000:]
    for rank in (0, 1):
        log = (tmp_path / "out" / "logs" / f"worker_{rank}.log").read_text()
        errors = [line for line in log.splitlines() if "ERROR" in line]
        assert len(errors) == 1 and "Traceback" not in log, errors
        refused = "on 2 workers: its global batch of 3 does not divide among them; 1, 3 workers would"
        assert refused in errors[0]
    # msrun's scheduler ends without a traceback, and MindSpore's cluster messages stay in the logs.
    console = resumed.console
    assert "Traceback" not in console and "DISTRIBUTED" not in console, console[-3000:]
    assert "Traceback" not in (tmp_path / "out" / "logs" / "scheduler.log").read_text()
    assert not (tmp_path / "out" / "checkpoints" / "epoch-0002.ckpt").exists()
    # The settings free to change (more epochs, another log interval, tracking) resume in
    # test_fault_tolerance.py.


# Rank 1 (msrun's DEVICE_ID on one node) sees every checkpoint but the newest, as a node with a stale copy
# would.
STALE_CHECKPOINTS = """
import os, sys
if sys.argv[0].endswith("main.py") and os.environ.get("DEVICE_ID") == "1":
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    from fmnist import checkpoints
    newest_first = checkpoints.newest_first
    checkpoints.newest_first = lambda directory: newest_first(directory)[1:]
"""


def test_ranks_that_find_different_checkpoints_end_plainly(tiny_data, tmp_path):
    first = run_sh(tmp_path, tiny_args(tiny_data, "out", "--tracking", "off", "--epochs", "2"), WORKERS="2")
    assert first.returncode == 0, first.console[-3000:]
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALE_CHECKPOINTS)
    rerun = run_sh(tmp_path, tiny_args(tiny_data, "out", "--tracking", "off", "--epochs", "3"), WORKERS="2",
                   PYTHONPATH=str(hook))
    assert rerun.returncode == common.EXIT_USAGE, rerun.console[-3000:]
    for rank in (0, 1):
        log = (tmp_path / "out" / "logs" / f"worker_{rank}.log").read_text()
        errors = [line for line in log.splitlines() if "ERROR" in line]
        assert len(errors) == 1 and "Traceback" not in log, errors
        assert re.search(r"ranks found different checkpoints to resume from \(steps \[(\d+), (\d+)\]\); is "
                         r"out/checkpoints shared by all nodes\?", errors[0]), errors[0]
    assert "Traceback" not in rerun.console
    assert not (tmp_path / "out" / "checkpoints" / "epoch-0003.ckpt").exists()


def test_checkpoint_of_an_older_job_version_is_refused(tiny_data, tmp_path):
    """A checkpoint as job 1.0.0 wrote it: another model, and no record of its settings."""
    import json  # pylint: disable=import-outside-toplevel
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    from mindspore import nn  # pylint: disable=import-outside-toplevel
    checkpoint_dir = tmp_path / "out" / "checkpoints"
    checkpoint_dir.mkdir(parents=True)
    old_model = nn.SequentialCell(nn.Conv2d(1, 6, 5, pad_mode="pad", padding=2),
                                  nn.Flatten(), nn.Dense(4704, 10))
    ms.save_checkpoint(old_model, str(checkpoint_dir / "epoch-0001.ckpt"), crc_check=True,
                       append_dict={"meta": json.dumps({"epoch": 1, "history": [], "loss_points": []})})
    result = run_main(tmp_path, tiny_args(tiny_data, tmp_path / "out", "--tracking", "off", "--epochs", "2"))
    assert result.returncode == common.EXIT_USAGE
    refused = f"checkpoint format: was 1 (written by job 1.0.0), now {checkpoints.CHECKPOINT_FORMAT}"
    assert refused in result.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


# --- one job per output directory


def test_second_job_on_an_output_dir_is_refused_and_a_killed_holder_blocks_nothing(longer_data, tmp_path):
    args = job_args(longer_data, "out", "--tracking", "off", "--epochs", "50")
    holder = subprocess.Popen([str(ROOT / "run.sh"), *args], cwd=tmp_path, env=job_env(WORKERS="2"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        logs = tmp_path / "out" / "logs"
        wait_for(logs / "worker_0.log", r"first step done", holder, timeout=180)
        workers = worker_pids(logs)
        pid = workers[0]
        # What the refused starts must leave alone: the holder's logs (msrun's and the scheduler's too) and
        # the lock's text naming it; each keeps its inode and its content so far (the holder keeps appending).
        kept = {path: (path.stat().st_ino, path.read_bytes())
                for path in [*logs.glob("*.log"), tmp_path / "out" / ".lock"]}
        assert {"worker_0.log", "worker_1.log", "scheduler.log", "msrun.log",
                ".lock"} <= {p.name for p in kept}
        started = time.monotonic()
        second = run_main(tmp_path, [*args, "--epochs", "1"], timeout=60)
        assert time.monotonic() - started < 30
        assert second.returncode == common.EXIT_USAGE
        assert re.search(rf"--output-dir out is in use by the job on host \S+, pid {pid}, started 20\d\d-",
                         second.stderr), second.stderr[-2000:]
        by_run_sh = subprocess.run([str(ROOT / "run.sh"), *args], cwd=tmp_path, env=job_env(WORKERS="2"),
                                   capture_output=True, text=True, timeout=60, check=False)
        assert by_run_sh.returncode == 2 and "out is in use by the job on host" in by_run_sh.stderr
        for path, (inode, content) in kept.items():
            assert path.stat().st_ino == inode and path.read_bytes().startswith(content), path.name
        job = job_processes(holder.pid)  # msrun, its scheduler and both workers
        assert set(workers) <= {process.pid for process in job}
        kill_all(job)  # every process of the job at once, as a crashed node would
        assert not any(alive(worker) for worker in workers)
    finally:
        kill_all(job_processes(holder.pid))
        holder.kill()
        holder.wait(timeout=60)
    # The lock is free: a job starts and finishes there (32 batches of 256 are enough to show it).
    after_crash = run_main(tmp_path,
                           [*args, "--epochs", "1", "--resume", "never", "--batch-size", "256"], timeout=300)
    assert after_crash.returncode == 0, after_crash.stderr[-3000:]


# --- SIGINT


def as_a_shells_foreground_job():
    """SIGINT and SIGTERM handled by default and not blocked, as a shell starts a command: bash cannot trap a
    signal ignored on entry, and the test process's state, whatever a test before left, is not the user's."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def test_sigint_under_a_shell_stops_every_rank_at_one_step_checkpoints_it_and_marks_the_run_killed(
        longer_data, tmp_path):
    """Ctrl-C in a terminal reaches run.sh alone (msrun runs in a session of its own): it ends with 130
    within the grace period, every rank stopped at the same step (run.sh passes SIGTERM on), and no worker
    outlives it. SIGTERM to run.sh as PID 1, and the resume from the checkpoint written here, are
    tests/test_preemption.py's."""
    # Six epochs: at full speed the three after the signal's point last seconds, longer than a loaded test may
    # take to send it.
    job = subprocess.Popen([str(ROOT / "run.sh"), *job_args(longer_data, "out", "--epochs", "6")],
                           cwd=tmp_path, env=job_env(WORKERS="2"), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, preexec_fn=as_a_shells_foreground_job)
    worker0 = tmp_path / "out" / "logs" / "worker_0.log"
    wait_for(worker0, r"epoch 2/6 \| step 16/", job, timeout=180)
    # The job's processes: both workers, and msrun's scheduler, which runs main.py too.
    job_workers = [p.pid for p in job_processes(job.pid) if runs_main_py(p)]
    assert len(job_workers) >= 2, job_workers
    signalled = time.monotonic()
    os.kill(job.pid, signal.SIGINT)
    _, stderr = job.communicate(timeout=120)
    stopped_after = time.monotonic() - signalled
    assert job.returncode == 130, stderr[-3000:]
    assert stopped_after < 30, stopped_after  # Kubernetes' default grace period
    log = worker0.read_text()
    stop = re.search(r"stopped by SIGTERM at step (\d+); checkpoint out/checkpoints/"
                     r"(epoch-0002-step-0*\d+\.ckpt) written, the next start resumes from it", log)
    assert stop, log[-2000:]
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == [
        "epoch-0001.ckpt", stop.group(2), "last-step"]
    assert not (tmp_path / "out" / "summary.json").exists()
    worker1 = (tmp_path / "out" / "logs" / "worker_1.log").read_text()
    stopped = f"rank 1 stops with the others: stopped by SIGTERM at step {stop.group(1)}"
    assert stopped in worker1, worker1[-2000:]
    assert not any(alive(pid) for pid in job_workers)  # no worker left behind: no kernel ended them here
    run_id = re.search(r"MLflow: run (\w+)", log).group(1)
    assert mlflow_run(tmp_path, run_id).info.status == "KILLED"


# --- two nodes


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, 10.203.0.1 and .2: two hosts of one test machine.
    Removed afterwards whatever happens (deleting a namespace deletes its end of the pair)."""
    suffix = os.getpid() % 100000
    names = [f"fmnist{suffix}n{i}" for i in (0, 1)]
    links = [f"fm{suffix}v{i}" for i in (0, 1)]

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for name in names:
            ip("netns", "add", name)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i, (name, link) in enumerate(zip(names, links)):
            ip("link", "set", link, "netns", name)
            ip("-n", name, "addr", "add", f"{NODE_ADDRESSES[i]}/24", "dev", link)
            ip("-n", name, "link", "set", link, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


NODE_ADDRESSES = ("10.203.0.1", "10.203.0.2")
NODE_LOSS_S = 30  # MS_NODE_TIMEOUT's 5 s, the scheduler's check and the exit (docs/testing.md)


def in_namespace(namespace, code, *args):
    """The JSON that Python `code` prints, run inside a network namespace."""
    result = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", code, *args],
                            capture_output=True, text=True, timeout=120, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def start_node(namespace, node_rank, cwd, args, **environment):
    """run.sh as one node of a 2-node job: in its own network namespace, and as PID 1 of its own PID
    namespace, so that killing it kills everything the node runs, as losing the machine would."""
    env = job_env(WORKERS="1", NODES="2", NODE_RANK=str(node_rank), MASTER_ADDR=NODE_ADDRESSES[0],
                  MASTER_PORT="8118", CLUSTER_TIMEOUT="120", **environment)
    command = ["ip", "netns", "exec", namespace, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
               str(ROOT / "run.sh"), *args]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_two_nodes_train_together_fail_together_and_resume(two_hosts, longer_data, tmp_path):
    args = job_args(longer_data, "out", "--tracking", "off", "--epochs", "2")
    nodes = [start_node(name, rank, tmp_path, args) for rank, name in enumerate(two_hosts)]
    try:
        worker0 = tmp_path / "out" / "logs" / "node0" / "worker_0.log"
        assert wait_for(worker0, r"rank 0 of (\d+)", nodes[0], timeout=180).group(1) == "2"
        wait_for(worker0, r"epoch 2/2 \| step 16/", nodes[0], timeout=180)
        killed_at = time.monotonic()
        nodes[1].kill()  # unshare --kill-child: node 1's PID 1 dies, and with it every process of the node
        console = nodes[0].communicate(timeout=300)[0]
        failed_after = time.monotonic() - killed_at
        print(f"node 0 ended {failed_after:.1f} s after node 1 was killed")
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
            node.communicate(timeout=60)
    # Node 0 names the lost rank and exits as a killed worker would (docs/operations.md), with no traceback,
    # within MS_NODE_TIMEOUT (run.sh's 5 s) and the scheduler's check of it.
    assert nodes[0].returncode == 128 + signal.SIGKILL, console[-3000:]
    assert ("run.sh: the job failed: rank 1 stopped answering for 5 s (frozen, stopped, or its node lost), "
            "and msrun ended the job") in console, console[-3000:]
    assert "another rank of the job is gone" in console and "Traceback" not in console, console[-3000:]
    assert failed_after < NODE_LOSS_S, failed_after
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("*.ckpt")) == ["epoch-0001.ckpt"]

    # The rerun is tracked (tracking may change on resume), to a server on node 0 that both nodes reach.
    with mlflow_server(tmp_path, host=NODE_ADDRESSES[0], port=5005,
                       prefix=["ip", "netns", "exec", two_hosts[0]]) as (url, _):
        tracked = dict(MLFLOW_TRACKING_URI=url, MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1")
        nodes = [start_node(name, rank, tmp_path, [*args, "--tracking", "on"], **tracked)
                 for rank, name in enumerate(two_hosts)]
        outputs = [node.communicate(timeout=600)[0] for node in nodes]
        assert [node.returncode for node in nodes] == [0, 0], [out[-2000:] for out in outputs]
        summary = read_summary(tmp_path / "out")
        metrics = in_namespace(two_hosts[0], "import json, sys, mlflow; print(json.dumps(sorted("
                               "mlflow.MlflowClient(sys.argv[1]).get_run(sys.argv[2]).data.metrics)))",
                               url, summary["mlflow_run_id"])
    assert "resuming from out/checkpoints/epoch-0001.ckpt: 1 of 2 epochs done" in worker0.read_text()
    assert (summary["world_size"], summary["replicas_identical"],
            summary["resumed_from_epoch"]) == (2, True, 1)
    assert "Node 0 holds the results" in outputs[1]
    # Node 0's system metrics, named after it: rank 0 samples them.
    assert "system/node0/cpu_utilization_percentage" in metrics, metrics
