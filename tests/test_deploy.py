"""The launcher, the image and the manifests: static checks with the real validators, and run.sh for real."""

import functools
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from fmnist import common, tracking
from conftest import ROOT, free_port, read_summary, rendered, run_sh, tiny_args

pytestmark = pytest.mark.timeout(600)
TOOLS = Path(sys.executable).parent  # shellcheck, hadolint, yamllint, kubernetes-validate come from PyPI
MANIFESTS = ["k8s-job.yaml", "overlays/multinode", "overlays/ascend-310p"]
# The operators' kinds are checked against their CRDs in test_operators.py; kubernetes-validate, the others'.
OPERATOR_MANIFESTS = ["k8s-ascendjob.yaml", "overlays/ascendjob-multinode",
                      "k8s-volcano.yaml", "k8s-trainer.yaml"]
# checkov has checks for none of the Trainer's kinds, nor for a PersistentVolumeClaim: k8s-trainer.yaml has
# nothing for it.
CHECKOV_MANIFESTS = [*MANIFESTS, *OPERATOR_MANIFESTS[:3]]


@functools.cache
def applied(manifest):
    """A file of the manifest as `kubectl apply` gets it: the file itself, or the overlay kustomize
    renders."""
    if manifest.endswith(".yaml"):
        return manifest
    path = Path(tempfile.mkdtemp()) / f"{manifest.replace('/', '-')}.yaml"
    path.write_text(yaml.safe_dump_all(rendered(manifest)))
    return str(path)


def written(manifest):
    """The YAML files a manifest is written in: the file itself, or the overlay's own."""
    if manifest.endswith(".yaml"):
        return [manifest]
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / manifest).glob("*.yaml"))


@pytest.fixture(scope="module")
def checkov():
    """checkov from its own venv (its pins would move the job's), once over every manifest, as its start
    costs seconds of CPU; returns its checks' results by the manifest's file."""
    files = {manifest: str((ROOT / applied(manifest)).resolve()) for manifest in CHECKOV_MANIFESTS}
    result = subprocess.run([str(ROOT / ".venv-checkov" / "bin" / "checkov"), "--skip-download", "--compact",
                             "--framework", "kubernetes", "--output", "json",
                             *(arg for path in files.values() for arg in ("-f", path))],
                            cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode in (0, 1) and result.stdout.startswith("{"), result.stdout + result.stderr
    results = json.loads(result.stdout)["results"]
    return {manifest: {outcome: [check for check in results[outcome] if check["file_abs_path"] == path]
                       for outcome in ("passed_checks", "failed_checks", "skipped_checks")}
            for manifest, path in files.items()}


def tool(name, *args):
    return subprocess.run([str(TOOLS / name), *args], cwd=ROOT, capture_output=True, text=True, check=False)


def test_run_sh_passes_shellcheck():
    assert "set -euo pipefail" in (ROOT / "run.sh").read_text()
    result = tool("shellcheck", "--severity=style", "run.sh")
    assert result.returncode == 0, result.stdout


def test_the_jobs_python_passes_ruff():
    """ruff.toml's rules: lines of at most 110 characters and no function of more than 5 parameters among
    them; the tests and the bench keep to the same lines, and to pycodestyle and pyflakes."""
    result = tool("ruff", "check", "--no-cache")
    assert result.returncode == 0, result.stdout
    result = tool("ruff", "check", "--no-cache", "--select", "E,F,W", "--config",
                  'include = ["tests/*.py", "bench/*.py"]')
    assert result.returncode == 0, result.stdout


def test_dockerfile_passes_hadolint():
    result = tool("hadolint", "Dockerfile")
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_manifest_is_valid_kubernetes(manifest):
    result = tool("kubernetes-validate", "--strict", applied(manifest))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed for resource job/" in result.stdout + result.stderr


@pytest.mark.parametrize("manifest", OPERATOR_MANIFESTS)
def test_operator_manifests_built_in_kinds_are_valid_kubernetes(manifest):
    result = tool("kubernetes-validate", "--strict", applied(manifest))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    built_in = [doc for doc in rendered(manifest) if doc["apiVersion"] == "v1"]
    for doc in built_in:
        assert f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}" in output, output


@pytest.mark.parametrize("manifest", MANIFESTS + OPERATOR_MANIFESTS)
def test_manifest_passes_yamllint(manifest):
    result = tool("yamllint", "--strict", *written(manifest))
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("manifest", CHECKOV_MANIFESTS)
def test_manifest_passes_checkov_with_justified_skips(checkov, manifest):
    checks = checkov[manifest]
    assert not checks["failed_checks"], [(c["check_id"], c["resource"]) for c in checks["failed_checks"]]
    # CKV_K8S_n=reason, by resource.
    skips = [(doc["kind"], doc["metadata"]["name"], *value.partition("=")[::2])
             for doc in rendered(manifest) for key, value in doc["metadata"].get("annotations", {}).items()
             if key.startswith("checkov.io/skip")]
    assert skips, "expected the documented skips"
    for *_, check, reason in skips:  # every skip says why
        assert re.fullmatch(r"CKV2?_K8S_\d+", check) and len(reason) > 10, (check, reason)
    # And each is a check checkov made of that resource: a skip of one that does not apply would show here.
    skipped = {(kind, name, check["check_id"]) for check in checks["skipped_checks"]
               for kind, _, name in [check["resource"].split(".", 2)]}
    assert {(kind, name, check) for kind, name, check, _ in skips} == skipped


def test_ascend_310p_overlay_requests_310p_devices_and_its_image():
    job = next(doc for doc in rendered("overlays/ascend-310p") if doc["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].endswith(":1.0.0-310p")
    for bound in ("requests", "limits"):
        npus = {k: v for k, v in container["resources"][bound].items() if k.startswith("huawei.com/")}
        assert npus == {"huawei.com/Ascend310P": 2}, bound


def test_the_multinode_overlay_is_the_job_indexed_over_two_servers():
    """What the overlay changes in k8s-job.yaml, and that the names it gives pod 0 and the Service agree."""
    docs = {doc["kind"]: doc for doc in rendered("overlays/multinode")}
    job, config, service = docs["Job"], docs["ConfigMap"]["data"], docs["Service"]
    assert (job["spec"]["completionMode"], job["spec"]["completions"], config["NODES"]) == ("Indexed", 2, "2")
    subdomain = job["spec"]["template"]["spec"]["subdomain"]
    assert config["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{subdomain}"
    assert service["metadata"]["name"] == subdomain
    assert service["spec"]["selector"]["job-name"] == job["metadata"]["name"]
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    claim = job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]


def test_dockerfile_builds_on_cann_for_910b_by_default_and_310p_on_request():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG CANN_CHIP=910b\n" in dockerfile
    assert "ARG BASE_IMAGE=quay.io/ascend/cann:8.5.0-${CANN_CHIP}-ubuntu22.04-py3.11\n" in dockerfile
    assert "--build-arg CANN_CHIP=310p" in dockerfile
    assert "--build-arg CANN_CHIP=310p" in (ROOT / "docs" / "deployment.md").read_text()


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_manifest_stops_retrying_bad_settings_and_divergence_and_allows_the_sigterm_stop(manifest):
    job = next(doc for doc in rendered(manifest) if doc["kind"] == "Job")
    fail_job = [rule for rule in job["spec"]["podFailurePolicy"]["rules"] if rule["action"] == "FailJob"]
    assert fail_job[0]["onExitCodes"]["values"] == [common.EXIT_USAGE, common.EXIT_DIVERGED,
                                                    common.EXIT_DISK_FULL]
    # run.sh stops the workers at their next log interval and waits at most 10 s for MLflow: within 30 s.
    assert job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 30
    assert tracking.STOP_TIMEOUT_S <= 10


def test_dockerignore_sends_only_what_the_image_copies():
    ignored = [line for line in (ROOT / ".dockerignore").read_text().split("\n") if line and line[0] != "#"]
    copies = [line.split()[1:-1] for line in (ROOT / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ")]
    assert ignored[0] == "*" and ignored[-1] == "**/__pycache__"
    sent = sorted(i.removeprefix("!") for i in ignored if i.startswith("!"))
    assert sent == sorted(source.rstrip("/") for sources in copies for source in sources)


# Rank 0, about to write its results, has run.sh signalled with SIGTERM, as a pod deleted then would be.
SIGNAL_AT_THE_RESULTS = """
import os, signal, sys, time
if sys.argv[0].endswith("main.py"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    from fmnist import outputs
    write_all = outputs.write_all

    def signalled(training, *args, **kwargs):
        pid = os.getppid()
        while "run.sh" not in open(f"/proc/{pid}/cmdline").read():
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not training.stop.signum and time.monotonic() < deadline:  # till run.sh has passed it on
            time.sleep(0.05)
        assert training.stop.signum == signal.SIGTERM, "run.sh did not pass the SIGTERM on"
        return write_all(training, *args, **kwargs)
    outputs.write_all = signalled
"""


def test_run_sh_trains_one_worker_from_another_directory(tiny_data, tmp_path):
    """Two workers from another directory: test_bad_input.py's run in directories with spaces and accents.
    Here a SIGTERM comes as the results are written: the job finishes them, and run.sh says it is done,
    exit 0."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SIGNAL_AT_THE_RESULTS)
    result = run_sh(tmp_path, tiny_args(tiny_data, "out", "--tracking", "off"), WORKERS="1",
                    PYTHONPATH=str(hook))
    assert "run.sh: stopping the workers" in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert read_summary(tmp_path / "out")["world_size"] == 1
    assert "Results: out/summary.json" in result.stdout
    assert (tmp_path / "out" / "logs" / "worker_0.log").is_file()


def test_run_sh_failure_names_the_worker_and_shows_its_log(tiny_data, tmp_path):
    (tmp_path / "empty").mkdir()
    # The tiny dataset's checksums: a system copy of the real data, where installed, cannot serve them either.
    args = ["--data-dir", "empty", "--checksums-file", str(tiny_data / "CHECKSUMS"), "--data-mirrors", "",
            "--output-dir", "out", "--tracking", "off"]
    result = run_sh(tmp_path, args, WORKERS="2")
    assert result.returncode == 2  # the worker's own status, which a podFailurePolicy can act on
    assert re.search(r"worker_0\.log, process \d+ exited with status 2: a bad setting or missing data",
                     result.stderr), result.stderr[-3000:]
    assert "the last lines of worker_0.log:" in result.stderr
    assert "cannot obtain train-images-idx3-ubyte" in result.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_node_of_the_scheduler_alone_reads_no_data_and_reports_msruns_own_failure(tmp_path):
    """An AscendJob's Scheduler pod (msrun's scheduler, no workers, no data volume) whose workers never come:
    the scheduler ends in one line after CLUSTER_TIMEOUT, and run.sh exits with msrun's status."""
    env = {"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(free_port()), "MS_LOCAL_WORKER": "1",
           "MS_WORKER_NUM": "1", "MS_NODE_RANK": "0", "MS_ROLE": "MS_SCHED", "CLUSTER_TIMEOUT": "3"}
    result = run_sh(tmp_path,
                    ["--checksums-file", "/no/such/CHECKSUMS", "--data-dir", "/no/such/data"], **env)
    assert result.returncode == 1, result.console[-3000:]
    assert "msrun's scheduler: the job ended early:" in result.console
    assert re.search(r"run.sh: all logs are in \S+/msrun-scheduler$", result.console.rstrip()), result.console
    assert "the job failed (msrun exit status 1)" in result.console and "Traceback" not in result.console


@pytest.mark.parametrize("env, message", [
    ({"WORKERS": "two"}, "WORKERS must be a whole number"),
    ({"NODES": "2"}, "NODES=2 needs MASTER_ADDR"),
    ({"NODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}, "NODE_RANK (2) must be below NODES (2)"),
])
def test_run_sh_rejects_bad_launch_settings(tmp_path, env, message):
    result = run_sh(tmp_path, [], timeout=30, **env)
    assert result.returncode == 2 and message in result.stderr


def test_run_sh_maps_an_indexed_job_pod_onto_msrun(tmp_path):
    """What pod 1 of a two-node Indexed Job would launch (msrun starts its scheduler only where MASTER_ADDR
    is local, so two nodes cannot share this one machine)."""
    env = {"NODES": "2", "WORKERS": "8", "MASTER_ADDR": "job-0.job",
           "JOB_COMPLETION_INDEX": "1", "DRY_RUN": "1"}
    result = run_sh(tmp_path, ["--epochs", "3"], timeout=30, **env)
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    for flag in ("--worker_num=16", "--local_worker_num=8", "--node_rank=1", "--master_addr=job-0.job",
                 "--master_port=8118", "--log_dir=outputs/logs/node1", "--join=True"):
        assert flag in command, (flag, command)
    assert command[-3:] == [str(ROOT / "main.py"), "--epochs", "3"]
    assert not (tmp_path / "outputs").exists()  # a dry run writes nothing


@pytest.mark.parametrize("variable", ["ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES"])
def test_run_sh_starts_one_worker_per_visible_npu(tmp_path, variable):
    """910B and 310P alike: the device plugin (or the user) names the visible NPUs, one worker each."""
    result = run_sh(tmp_path, [], timeout=30, DRY_RUN="1", **{variable: "0,1,2"})
    assert result.returncode == 0, result.stderr
    assert "--local_worker_num=3" in shlex.split(result.stdout)
