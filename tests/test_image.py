"""The image, built from the real Dockerfile and run with podman as `docker run` and Kubernetes run it.

podman stands in for both: no Docker engine and no Kubernetes API run here. `podman kube play` runs Pods, not
Jobs, so each Job's Pod is derived from the Job's own template (`pod_of`), changed only where this machine
differs from an Ascend cluster: no NPUs (the huawei.com resources and the driver's host files go), no registry
(the image is the one built here, never pulled), a small run (the ConfigMap's sizes), and what podman does
otherwise than Kubernetes (a containerPort, an emptyDir's name, DNS for the headless Service). What only a
real API server checks, the Job's own fields, stays with kubernetes-validate and checkov in test_deploy.py.

These tests take minutes (the image builds in about 3): `make test-image` runs them, as root, after installing
podman, runc and mmdebstrap from Debian; `make test` leaves them out.
"""

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, rendered, write_dataset

pytestmark = [pytest.mark.image, pytest.mark.timeout(1200)]

CONF = Path(__file__).with_name("containers.conf")
BASE = "localhost/fashion-mnist-test-base:bookworm"  # what python:3.11-slim-bookworm is built on
IMAGE = "localhost/fashion-mnist-mindspore:test"
# The build reaches PyPI as this machine does, through the Dockerfile's build secrets: none of it lands in the
# image.
BUILD_SECRETS = {"pip.conf": "/etc/pip.conf", "ca-bundle": "/etc/ssl/certs/ca-certificates.crt"}
JOB_UID = 1000  # the manifests' runAsUser and the image's USER
# The Job's security context as `podman run` flags (the pod tests take it from the manifests themselves).
AS_THE_JOB = ["--user=1000:1000", "--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges",
              "--tmpfs=/tmp", "--env=HOME=/tmp"]
SMALL_RUN = {"EPOCHS": "2", "BATCH_SIZE": "16", "LOG_INTERVAL": "2", "DATA_MIRRORS": "", "TRACKING": "off",
             "CHECKSUMS_FILE": "/workspace/data/CHECKSUMS"}
GRACE_SECONDS = 30  # the manifests' terminationGracePeriodSeconds


def podman(*args, check=True, timeout=600):
    result = subprocess.run(["podman", *args], env={**os.environ, "CONTAINERS_CONF": str(CONF)},
                            capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert result.returncode == 0, f"podman {' '.join(args[:3])}: {result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="session")
def image(tmp_path_factory):
    """The CPU image from the real Dockerfile on a Debian bookworm base made here (no registry is
    reachable)."""
    missing = [tool for tool in ("podman", "runc", "mmdebstrap") if not shutil.which(tool)]
    if missing or os.geteuid() != 0:
        why = f"{', '.join(missing) or 'root'} needed"
        if os.environ.get("IMAGE_TESTS") == "required":
            pytest.fail(f"the image tests cannot run here: {why}")
        pytest.skip(f"{why}: run `sudo make test-image`, which installs podman, runc and mmdebstrap (Debian)")
    if podman("image", "exists", BASE, check=False).returncode != 0:
        tarball = tmp_path_factory.mktemp("base") / "bookworm.tar"
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase",
                        "--include=python3,python3-venv", "bookworm", str(tarball)], check=True, timeout=600)
        podman("import", str(tarball), BASE)
    started = time.monotonic()
    podman("build", "--build-arg", f"BASE_IMAGE={BASE}", "--build-arg", "GIT_COMMIT=test",
           *[f"--secret=id={name},src={path}" for name, path in BUILD_SECRETS.items() if Path(path).exists()],
           "--tag", IMAGE, str(ROOT), timeout=1800)
    podman("image", "prune", "--force")  # the image this build replaced
    size = json.loads(podman("image", "inspect", IMAGE).stdout)[0]["Size"]
    print(f"\nimage built in {time.monotonic() - started:.0f} s (layer cache included): {size / 1e9:.2f} GB")
    return IMAGE


@pytest.fixture
def workspace(tmp_path):
    """The job's volume: a small dataset in data/, owned by the job's user as fsGroup would make it."""
    root = tmp_path / "workspace"
    write_dataset(root / "data")
    chown_tree(root, JOB_UID)
    return root


def chown_tree(root, uid):
    for path in [root, *root.rglob("*")]:
        os.chown(path, uid, uid)


def foreign_files(root):
    """Files on the volume that the job's user does not own."""
    return [str(p) for p in [root, *root.rglob("*")] if p.stat().st_uid != JOB_UID]


def env_flags(env):
    return [f"--env={name}={value}" for name, value in env.items()]


# --- the image alone, as `docker run` runs it


def test_image_holds_the_job_and_nothing_of_the_build(image):
    script = """ls /opt/job /opt/job/fmnist
                echo "package lists: $(ls -A /var/lib/apt/lists | wc -l)"
                for path in /root/.cache /etc/pip.conf; do [ -e $path ] && echo "left: $path"; done
                for tool in gcc cc make; do command -v $tool >/dev/null && echo "left: $tool"; done; true"""
    listing = podman("run", "--rm", "--user=0", "--entrypoint=/bin/sh", image, "-c", script).stdout
    lines = set(listing.splitlines())
    assert {"main.py", "run.sh", "requirements.txt", "settings.py", "package lists: 0"} <= lines, listing
    assert "tests" not in lines and "__pycache__" not in lines
    assert "left:" not in listing, listing  # no pip cache, none of the build's secrets, no build tools


def test_a_change_to_the_code_rebuilds_without_reinstalling_the_packages(image, tmp_path):
    """The build context with main.py changed and another commit: every step up to the code's is cached."""
    context = tmp_path / "context"
    shutil.copytree(ROOT, context,
                    ignore=shutil.ignore_patterns(".*", "tests", "bench", "outputs", "__pycache__"))
    shutil.copy(ROOT / ".dockerignore", context)
    with (context / "main.py").open("a") as source:
        source.write("# changed\n")
    build = podman("build", "--build-arg", f"BASE_IMAGE={BASE}", "--build-arg", "GIT_COMMIT=another",
                   "--tag", f"{IMAGE}-changed", str(context))
    podman("rmi", f"{IMAGE}-changed")
    steps = re.split(r"^STEP \d+/\d+: ", build.stdout, flags=re.MULTILINE)[1:]
    rebuilt = [step.splitlines()[0] for step in steps[1:] if "Using cache" not in step]  # after FROM
    assert rebuilt[0].startswith("COPY main.py"), rebuilt


def test_image_trains_two_workers_with_the_jobs_security_context(image, workspace):
    result = podman("run", "--rm", *AS_THE_JOB, f"--volume={workspace}:/workspace",
                    *env_flags(SMALL_RUN), image, check=False)
    console = result.stdout + result.stderr
    assert result.returncode == 0, console[-3000:]
    summary = json.loads((workspace / "outputs" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["replicas_identical"] is True
    assert len(summary["epoch_history"]) == 2  # the setting came through the environment
    assert foreign_files(workspace) == []
    assert "Traceback" not in console and "ERROR" not in console


def test_podman_stop_ends_the_job_in_its_grace_period_and_the_next_start_resumes(image, workspace, tmp_path):
    write_dataset(workspace / "data", splits={"train": 8192, "t10k": 256})  # epochs of a second or two
    chown_tree(workspace, JOB_UID)
    name = f"fmnist-stop-{os.getpid()}"
    run = ["run", *AS_THE_JOB, f"--volume={workspace}:/workspace", *env_flags({**SMALL_RUN, "EPOCHS": "6"})]
    podman(*run, "--detach", f"--name={name}", image)
    try:
        worker0 = workspace / "outputs" / "logs" / "worker_0.log"
        deadline = time.monotonic() + 300
        while not (worker0.exists() and re.search(r"epoch 2/6 \| step 16/",
                                                  worker0.read_text(errors="replace"))):
            assert time.monotonic() < deadline, podman("logs", name, check=False).stderr[-3000:]
            assert podman("container", "inspect", "--format={{.State.Running}}",
                          name).stdout.strip() == "true"
            time.sleep(0.5)
        signalled = time.monotonic()
        podman("stop", f"--time={GRACE_SECONDS}", name, timeout=GRACE_SECONDS + 30)
        stopped_after = time.monotonic() - signalled
        status = int(podman("wait", name).stdout.strip())
        logs = podman("logs", name).stderr
    finally:
        podman("rm", "--force", name, check=False)
    print(f"podman stop took {stopped_after:.1f} s")
    # 143, not 137: the job ended on its own within the grace period, before podman's SIGKILL.
    assert status == 128 + signal.SIGTERM, logs[-3000:]
    assert "run the same command again to resume" in logs
    # The ranks agree on a step after the signal: podman delivers it a second or more later, an epoch here at
    # full speed, so any epoch's step or end.
    stopped_at = re.search(r"checkpoint \S+/(epoch-\d{4}(?:-step-\d{6})?\.ckpt) written", worker0.read_text())
    assert stopped_at, worker0.read_text()[-3000:]
    rerun = podman(*run, "--rm", image, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # From the step the job stopped at, which it checkpointed before exiting.
    assert f"/{stopped_at.group(1)}: " in re.search(r"resuming from .*", worker0.read_text()).group(0)
    assert json.loads((workspace / "outputs" / "summary.json").read_text())["replicas_identical"] is True
    assert foreign_files(workspace) == []


# --- the manifests' own pods


def as_pod(name, template, env=None, host_aliases=None, resources=None):
    """The Pod a controller would create from a pod template, less what needs an Ascend server, with `env`
    (what the controller injects) set in each container, `host_aliases` standing in for its Services'
    names, and `resources` for a runtime that sets them per node."""
    spec = copy.deepcopy(template["spec"])
    # The hostPath volumes are the Ascend driver's files.
    driver_files = {volume["name"] for volume in spec["volumes"] if "hostPath" in volume}
    spec["volumes"] = [volume for volume in spec["volumes"] if volume["name"] not in driver_files]
    for container in spec["containers"]:
        container["image"], container["imagePullPolicy"] = IMAGE, "Never"
        # Kubernetes only lists a containerPort; podman 4 publishes it on the host, where two pods collide.
        container.pop("ports", None)
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] not in driver_files]
        container["resources"] = copy.deepcopy(resources or container.get("resources", {}))
        for part in ("requests", "limits"):
            wanted = container["resources"].get(part, {})
            container["resources"][part] = {key: value for key, value in wanted.items()
                                            if not key.startswith("huawei.com/")}
        container["env"] = [e for e in container.get("env", []) if e["name"] not in (env or {})]
        container["env"] += [{"name": key, "value": value} for key, value in (env or {}).items()]
        # podman names an emptyDir's volume after it alone: one per pod
        for mount in container["volumeMounts"]:
            if any("emptyDir" in v and v["name"] == mount["name"] for v in spec["volumes"]):
                mount["name"] = f"{mount['name']}-{name}"
    for volume in spec["volumes"]:
        if "emptyDir" in volume:
            volume["name"] = f"{volume['name']}-{name}"
    spec.setdefault("restartPolicy", "Never")  # an operator recreates a failed pod itself, if at all
    if host_aliases:
        spec["hostAliases"] = host_aliases
    labels = template.get("metadata", {}).get("labels", {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def pod_of(job, index=None):
    """The Pod a Job's controller would create, with the index an Indexed Job's controller adds."""
    name = job["metadata"]["name"] if index is None else f"{job['metadata']['name']}-{index}"
    return as_pod(name, job["spec"]["template"],
                  None if index is None else {"JOB_COMPLETION_INDEX": str(index)})


@pytest.fixture
def volumes(workspace):
    """Binds a pod's PersistentVolumeClaim to the workspace, as podman's volume of the claim's name."""
    created = set()

    def bind(pod):
        for volume in pod["spec"]["volumes"]:
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim and claim not in created:
                podman("volume", "create", "--opt=type=none", "--opt=o=bind",
                       f"--opt=device={workspace}", claim)
                created.add(claim)

    yield bind
    for claim in created:
        podman("volume", "rm", "--force", claim, check=False)


def play(pods, tmp_path, *flags):
    """`podman kube play` of the given documents; the pods' names, to end them afterwards."""
    path = tmp_path / f"{pods[-1]['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump_all(pods))
    podman("kube", "play", *flags, str(path))
    return path


def wait(container, timeout=600):
    return int(podman("wait", container, timeout=timeout).stdout.strip())


@pytest.mark.parametrize("manifest", ["k8s-job.yaml", "overlays/ascend-310p"])
def test_the_jobs_own_pod_trains_as_kubernetes_would_run_it(image, manifest, workspace, volumes, tmp_path):
    docs = rendered(manifest)
    job = next(doc for doc in docs if doc["kind"] == "Job")
    config = next(doc for doc in docs if doc["kind"] == "ConfigMap")
    del config["data"]["MLFLOW_TRACKING_URI"]  # the cluster's server; tracking is tested in test_tracking.py
    config["data"].update(SMALL_RUN)
    pod = pod_of(job)
    volumes(pod)
    container = f"{pod['metadata']['name']}-{pod['spec']['containers'][0]['name']}"
    path = play([config, pod], tmp_path)
    try:
        status = wait(container)
        inspected = json.loads(podman("container", "inspect", container).stdout)[0]
        logs = podman("logs", container).stdout + podman("logs", container).stderr
    finally:
        podman("kube", "down", str(path), check=False)
    assert status == 0, logs[-3000:]
    summary = json.loads((workspace / "outputs" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["replicas_identical"] is True
    assert len(summary["epoch_history"]) == 2  # the ConfigMap's EPOCHS
    assert foreign_files(workspace) == []
    # The manifest's security context and limits, as podman applied them.
    host = inspected["HostConfig"]
    assert inspected["Config"]["User"] == "1000:1000"
    assert host["ReadonlyRootfs"] is True and "no-new-privileges" in host["SecurityOpt"]
    assert inspected["EffectiveCaps"] in (None, [])
    assert host["Memory"] == 64 * 2**30
    assert host["NanoCpus"] == 16 * 10**9
    assert {mount["Destination"] for mount in inspected["Mounts"] if mount["RW"]} == {"/workspace", "/tmp"}


def train_together(pods, tmp_path, volumes, workspace, config=None):
    """The pods on one podman network, pod i at SUBNET.(10 + i), each with its own `podman kube play` (and
    the ConfigMap they read), their volumes bound to the workspace; once all have ended, each must have
    exited 0 and the two replicas of their world must be identical. Their logs."""
    network = f"fmnist-{os.getpid()}"
    podman("network", "create", f"--subnet={SUBNET}.0/24", network)
    containers = [f"{pod['metadata']['name']}-{pod['spec']['containers'][0]['name']}" for pod in pods]
    played = []
    try:
        for index, pod in enumerate(pods):
            volumes(pod)
            documents = [config, pod] if config else [pod]
            played.append(play(documents, tmp_path, f"--network={network}", f"--ip={SUBNET}.{10 + index}"))
        statuses = [wait(container) for container in containers]
        logs = [podman("logs", container) for container in containers]
        logs = [log.stdout + log.stderr for log in logs]
    finally:
        for path in played:
            podman("kube", "down", str(path), check=False)
        podman("network", "rm", "--force", network, check=False)
    assert statuses == [0] * len(statuses), logs
    summary = json.loads((workspace / "outputs" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["replicas_identical"] is True
    assert foreign_files(workspace) == []
    return logs


def node_logs(workspace):
    return sorted(p.name for p in (workspace / "outputs" / "logs").iterdir())


SUBNET = "10.89.77"


def test_the_multinode_jobs_two_pods_train_together(image, workspace, volumes, tmp_path):
    """Index 0 and 1 of the Indexed Job, on one network. In Kubernetes, index 0's name in MASTER_ADDR resolves
    through the Job's headless Service; here each pod's /etc/hosts names index 0's fixed address."""
    docs = rendered("overlays/multinode")
    job, config = (next(doc for doc in docs if doc["kind"] == kind) for kind in ("Job", "ConfigMap"))
    del config["data"]["MLFLOW_TRACKING_URI"]  # the cluster's server; tracking is tested in test_tracking.py
    # One worker a pod, set where the pods read it: podman's envFrom wins over a container's env.
    config["data"].update(SMALL_RUN, WORKERS="1")
    pods = [as_pod(f"{job['metadata']['name']}-{index}", job["spec"]["template"],
                   {"JOB_COMPLETION_INDEX": str(index)},
                   [{"ip": f"{SUBNET}.10", "hostnames": [config["data"]["MASTER_ADDR"]]}])
            for index in (0, 1)]
    train_together(pods, tmp_path, volumes, workspace, config)
    assert node_logs(workspace) == ["node0", "node1"]


# --- the cluster's job operators' pods, as each operator would create them


def test_the_ascendjobs_scheduler_and_worker_pods_train_together(image, workspace, volumes, tmp_path):
    """The single-server AscendJob's Scheduler and Worker pods, named as ascend-operator names them
    (<job>-<replica type>-<index>, pod.go), with the variables it gives the container named ascend
    (component/ascend-operator/pkg/controllers/v1/env.go, setMindSporeEnv): the Scheduler's MS_SCHED_HOST
    is its own pod IP; the Worker's is the Scheduler's Service, here the Scheduler pod's fixed address.
    MS_LOCAL_WORKER is the NPUs the Worker requests (2), MS_WORKER_NUM that times the pods with NPUs (1),
    NPU_POD whether this pod requests any. run.sh reads only these: the manifest sets no WORKERS, NODES or
    MASTER_ADDR."""
    docs = rendered("k8s-ascendjob.yaml")
    job, config = (next(doc for doc in docs if doc["kind"] == kind) for kind in ("AscendJob", "ConfigMap"))
    del config["data"]["MLFLOW_TRACKING_URI"]  # the cluster's server; tracking is tested in test_tracking.py
    config["data"].update(SMALL_RUN)
    injected = {"MS_SCHED_HOST": f"{SUBNET}.10", "MS_SCHED_PORT": "2222", "MS_LOCAL_WORKER": "2",
                "MS_WORKER_NUM": "2", "MS_NODE_RANK": "0", "MS_SERVER_NUM": "0"}
    specs = job["spec"]["replicaSpecs"]
    pods = [as_pod(f"{job['metadata']['name']}-scheduler-0", specs["Scheduler"]["template"],
                   {**injected, "MS_ROLE": "MS_SCHED", "NPU_POD": "false"}),
            as_pod(f"{job['metadata']['name']}-worker-0", specs["Worker"]["template"],
                   {**injected, "MS_ROLE": "MS_WORKER", "NPU_POD": "true"})]
    for pod in pods:
        own = {item["name"] for item in pod["spec"]["containers"][0]["env"]}
        assert not {"WORKERS", "NODES", "NODE_RANK", "MASTER_ADDR"} & own
    logs = train_together(pods, tmp_path, volumes, workspace, config)
    assert "node 0 of 1, 0 worker(s), scheduler" in logs[0]
    assert "node 0 of 1, 2 worker(s), scheduler" in logs[1]


def test_the_volcano_jobs_two_pods_train_together(image, workspace, volumes, tmp_path):
    """The task's two pods with what Volcano gives them: the env plugin's VC_TASK_INDEX (and VK_TASK_INDEX),
    and the svc plugin's names, pod 0's through hostAliases (volcano-sh/volcano,
    docs/user-guide/how_to_use_svc_plugin.md and the env plugin). run.sh takes VC_TASK_INDEX for NODE_RANK."""
    job = next(doc for doc in rendered("k8s-volcano.yaml") if doc["kind"] == "Job")
    name, task = job["metadata"]["name"], job["spec"]["tasks"][0]
    pods = [as_pod(f"{name}-{task['name']}-{index}", task["template"],
                   {"VC_TASK_INDEX": str(index), "VK_TASK_INDEX": str(index), "WORKERS": "1",
                    "MLFLOW_TRACKING_URI": "", **SMALL_RUN},
                   [{"ip": f"{SUBNET}.10", "hostnames": [f"{name}-{task['name']}-0.{name}"]}])
            for index in (0, 1)]
    train_together(pods, tmp_path, volumes, workspace)
    assert node_logs(workspace) == ["node0", "node1"]


def test_the_trainjobs_two_nodes_train_together(image, workspace, volumes, tmp_path):
    """The runtime's node job with the TrainJob's env and resourcesPerNode, as Trainer's PlainML policy and
    JobSet build it (kubeflow/trainer, manifests/base/runtimes): an Indexed Job's pods, with
    JOB_COMPLETION_INDEX, and pod 0's name, <trainjob>-node-0-0.<trainjob>, through hostAliases."""
    docs = rendered("k8s-trainer.yaml")
    runtime, trainjob = (next(doc for doc in docs if doc["kind"] == kind)
                         for kind in ("ClusterTrainingRuntime", "TrainJob"))
    node = next(j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "node")
    env = {item["name"]: item["value"] for item in trainjob["spec"]["trainer"]["env"]}
    pods = [as_pod(f"{trainjob['metadata']['name']}-node-0-{index}", node["template"]["spec"]["template"],
                   {**env, "JOB_COMPLETION_INDEX": str(index), "WORKERS": "1", "MLFLOW_TRACKING_URI": "",
                    **SMALL_RUN}, [{"ip": f"{SUBNET}.10", "hostnames": [env["MASTER_ADDR"]]}],
                   trainjob["spec"]["trainer"]["resourcesPerNode"]) for index in (0, 1)]
    train_together(pods, tmp_path, volumes, workspace)
