"""The real job end to end: msrun with 2 CPU workers, and a lone process, on tiny generated data."""

import math
import re

import pytest

from conftest import job_env, read_summary, run_main, run_msrun, serve, tiny_args

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
        # oneDNN prints the instruction set it dispatches to: the proof that the job's default cap took
        # effect.
        result = run_msrun(cwd, args, env=job_env(ONEDNN_VERBOSE="profile_create"))
    return cwd, result, mirror


def test_data_is_downloaded_once_per_job_not_per_rank(two_worker_run):
    cwd, result, mirror = two_worker_run
    assert result.returncode == 0, result.logs
    assert sorted(mirror.requests.values()) == [1, 1, 1, 1]
    fetched = sorted(p.name for p in (cwd / "data").glob("*-ubyte"))
    assert fetched == sorted(name.removesuffix(".gz") for name in mirror.files)


def test_msrun_job_exits_zero_with_identical_replicas(two_worker_run):
    cwd, result, _ = two_worker_run
    assert result.returncode == 0, result.logs
    summary = read_summary(cwd / "out")
    assert summary["replicas_identical"] is True
    assert (summary["world_size"], summary["device"], summary["epochs"]) == (2, "CPU", 1)
    # Every one of the 96 test images counted exactly once across the two ranks' slices, and the final figure
    # is the last validation's.
    assert summary["test_samples"] == 96
    assert summary["test_accuracy"] * 96 == pytest.approx(round(summary["test_accuracy"] * 96))
    assert summary["test_accuracy"] == summary["epoch_history"][-1]["val_accuracy"]
    assert math.isfinite(summary["test_loss"])
    for key in ("train_samples_per_s", "wall_s", "first_step_s"):
        assert summary[key] > 0, key


def test_a_good_run_logs_no_error_and_no_traceback(two_worker_run):
    _, result, _ = two_worker_run
    assert result.returncode == 0, result.logs
    for name, text in {"console": result.stdout + result.stderr, **result.logs}.items():
        assert not [line for line in text.splitlines() if "ERROR" in line or "Traceback" in line], name


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
    assert client.search_registered_models() == []  # registering is asked for with --register-model


def test_a_single_process_without_msrun_learns_the_tiny_task(tiny_data, tmp_path):
    """Ten short epochs on data whose class is a bright band: far above the 0.1 of guessing."""
    result = run_main(tmp_path, tiny_args(tiny_data, tmp_path / "out", "--tracking", "off", "--epochs", "10"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "out")
    assert summary["world_size"] == 1 and summary["test_accuracy"] >= 0.5
    assert summary["mlflow_run_id"] is None and not (tmp_path / "mlflow.db").exists()


def test_workers_have_the_onednn_isa_cap_and_disjoint_cores(two_worker_run):
    cwd, result, _ = two_worker_run
    assert result.returncode == 0, result.logs
    cores = []
    for rank in (0, 1):
        log = result.logs[f"worker_{rank}.log"]
        assert "onednn_verbose,v1,info,cpu,isa:Intel AVX2" in log, log[-3000:]
        assert "oneDNN ISA cap AVX2" in log
        cores.append(set(map(int, re.search(r"threads on cores \[([\d, ]+)\]", log).group(1).split(","))))
    assert cores[0] and cores[1] and not cores[0] & cores[1], cores
    summary = read_summary(cwd / "out")
    assert summary["cpu"]["onednn_isa_cap"] == "AVX2" and summary["cpu"]["model"]
    assert (summary["amp_level"], summary["loss_scaling"], summary["features_dtype"]) == ("O0", "none",
                                                                                           "Float32")
    # Float32 throughout, unscaled.
    assert (summary["amp_logit_error"], summary["step_loss_scale"]) == (0.0, 1.0)


@pytest.fixture(scope="module")
def o2_run(tiny_data, tmp_path_factory):
    """The article's O2 on 2 workers with a fixed loss scale, under a user's own oneDNN cap: two checks,
    one job."""
    cwd = tmp_path_factory.mktemp("o2")
    args = tiny_args(tiny_data, cwd / "out", "--tracking", "off", "--amp", "O2", "--loss-scale", "1024",
                     "--epochs", "10")
    return cwd, run_msrun(cwd, args, env=job_env(ONEDNN_MAX_CPU_ISA="SSE41", ONEDNN_VERBOSE="profile_create"))


def test_a_users_isa_cap_wins(o2_run):
    cwd, result = o2_run
    assert result.returncode == 0, result.logs
    for rank in (0, 1):
        assert "onednn_verbose,v1,info,cpu,isa:Intel SSE4.1" in result.logs[f"worker_{rank}.log"]
    assert read_summary(cwd / "out")["cpu"]["onednn_isa_cap"] == "SSE41"


def test_mixed_precision_o2_with_two_workers_computes_in_float16_and_learns(o2_run):
    """The article's O2, float16 compute with float32 master weights, on 2 CPU workers; the loss scaled by the
    fixed factor, which the optimizer divides back out."""
    cwd, result = o2_run
    assert result.returncode == 0, result.logs
    summary = read_summary(cwd / "out")
    assert (summary["amp_level"], summary["loss_scaling"],
            summary["step_loss_scale"]) == ("O2", "fixed:1024", 1024)
    assert summary["features_dtype"] == "Float16"  # the convolutions' output, measured on the trained network
    assert 0 < summary["amp_logit_error"] < 0.1  # float16 rounding, not a different network
    assert summary["replicas_identical"] is True and summary["world_size"] == 2
    assert summary["test_accuracy"] >= 0.5


@pytest.mark.parametrize("amp, dtype", [
    ("O1", "Float32"),  # O1 casts back to float32 after each float16 layer
    ("O3", "Float16"),
])
def test_the_other_amp_levels_run_on_cpu(tiny_data, tmp_path, amp, dtype):
    """Observed in what the train step computes (O0 and O2 above): float16 somewhere in its forward pass moves
    the logits off float32 (O0 shows exactly 0), unscaled."""
    result = run_main(tmp_path, tiny_args(tiny_data, tmp_path / "out", "--tracking", "off", "--amp", amp))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "out")
    assert (summary["amp_level"], summary["features_dtype"], summary["loss_scaling"]) == (amp, dtype, "none")
    assert 0 < summary["amp_logit_error"] < 0.1  # float16 rounding, not a different network
    assert summary["step_loss_scale"] == 1.0
    assert math.isfinite(summary["test_loss"])
