"""The manifests for the cluster's job operators: MindCluster's AscendJob, Volcano's Job and Kubeflow
Trainer's ClusterTrainingRuntime and TrainJob.

- Each custom resource against its CRD's openAPIV3Schema (tests/crds, copied unchanged from each project's
  repository), with unknown fields refused, as kubeconform does, so that a misspelt field fails.
- The rules each operator checks in its own code, which no schema states (OPERATOR_RULES below). The schema
  cannot make one more kind of check: the CEL rules (x-kubernetes-validations) of Trainer's CRDs, which the
  API server runs and a JSON-schema validator ignores. Of those, the one a new resource can break is
  mlPolicy's "only one of the policies", checked here by hand; the others say that fields are immutable once
  created.
- A broken copy of each manifest fails: a misspelt field, a container not named `ascend`, two Scheduler
  replicas, a missing gang size, and more.
- run.sh, given what each operator injects, prints the msrun command docs/deployment.md says it will.
"""

import copy
import shlex
import subprocess

import jsonschema
import pytest
import yaml

from conftest import CRDS, ROOT, job_env, rendered

CRD_FILES = {"AscendJob": "ascendjobs.mindxdl.gitee.com.yaml", "Job": "jobs.batch.volcano.sh.yaml",
             "ClusterTrainingRuntime": "clustertrainingruntimes.trainer.kubeflow.org.yaml",
             "TrainJob": "trainjobs.trainer.kubeflow.org.yaml"}
MANIFESTS = ["k8s-ascendjob.yaml", "overlays/ascendjob-multinode", "overlays/ascendjob-310p",
             "overlays/ascendjob-multinode-310p", "k8s-volcano.yaml", "k8s-trainer.yaml"]
NPUS = ("huawei.com/Ascend910", "huawei.com/Ascend310P")


def custom_resources(manifest):
    return [doc for doc in rendered(manifest) if doc["kind"] in CRD_FILES and doc["apiVersion"] != "batch/v1"]


def strict(schema):
    """The schema with unknown fields refused wherever it lists the known ones (as kubeconform's
    openapi2jsonschema does)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict(item) for item in schema]
    return schema


def schema_errors(doc):
    crd = yaml.safe_load((CRDS / CRD_FILES[doc["kind"]]).read_text())
    version = doc["apiVersion"].split("/")[-1]
    schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)
    group = doc["apiVersion"].split("/")[0]
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, doc["kind"])
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
            for error in jsonschema.Draft7Validator(strict(schema)).iter_errors(doc)]


def env_of(container):
    return {item["name"]: item.get("value") for item in container.get("env", [])}


def ascendjob_rules(job):
    """ascend-operator's own checks (pkg/controllers/v1/ascendjob_validate.go, env.go): the framework label,
    exactly one Scheduler replica beside the Workers, a container named `ascend` (the only one the operator
    gives its variables) with the port `ascendjob-port`, NPUs requested by the Workers; and the gang of every
    pod."""
    specs, problems = job["spec"]["replicaSpecs"], []
    if job["metadata"].get("labels", {}).get("framework") != "mindspore":
        problems.append("the label framework: mindspore is missing")
    if set(specs) - {"Scheduler", "Worker"} or specs.get("Scheduler", {}).get("replicas") != 1:
        problems.append(f"MindSpore needs exactly one Scheduler replica and Workers, got {sorted(specs)} "
                        f"with {specs.get('Scheduler', {}).get('replicas')} Scheduler(s)")
    for rtype, spec in specs.items():
        if spec.get("restartPolicy") != "ExitCode":
            problems.append(f"{rtype}: restartPolicy ExitCode retries a stopped or killed job, and no other")
        ascend = next((c for c in spec["template"]["spec"]["containers"] if c["name"] == "ascend"), None)
        if ascend is None:
            problems.append(f"{rtype}: no container named ascend")
            continue
        if "ascendjob-port" not in [port.get("name") for port in ascend.get("ports", [])]:
            problems.append(f"{rtype}: no port named ascendjob-port")
        requests = ascend.get("resources", {}).get("requests", {})
        if rtype == "Worker" and not any(requests.get(npu) for npu in NPUS):
            problems.append("Worker: requests no NPU")
    gang = job["spec"].get("runPolicy", {}).get("schedulingPolicy", {}).get("minAvailable")
    if gang != sum(spec["replicas"] for spec in specs.values()):
        problems.append(f"the gang size minAvailable is {gang}, not every pod")
    return problems


def volcano_rules(job):
    """The gang, the svc and env plugins run.sh relies on (pod 0's name, VC_TASK_INDEX), and the policies:
    exit 2, 3 and 4 abort the job, eviction restarts it. Volcano applies the first policy that matches
    (pkg/controllers/job/job_controller_util.go, applyPolicies), so the exit codes must come first."""
    spec, problems = job["spec"], []
    name, nodes = job["metadata"]["name"], sum(task["replicas"] for task in job["spec"]["tasks"])
    if spec.get("minAvailable") != nodes:
        problems.append(f"the gang size minAvailable is {spec.get('minAvailable')}, not the {nodes} pods")
    if not {"svc", "env"} <= set(spec.get("plugins", {})):
        problems.append("the svc and env plugins are needed")
    policies = spec.get("policies", [])
    events = [i for i, p in enumerate(policies) if p.get("event") in ("PodFailed", "*")]
    first_event = events[0] if events else len(policies)
    aborts = {p.get("exitCode") for p in policies[:first_event] if p.get("action") == "AbortJob"}
    if not {2, 3, 4} <= aborts:
        problems.append("exit 2, 3 and 4 must abort the job before any PodFailed policy; "
                        f"abort: {sorted(aborts)}")
    if {"event": "PodEvicted", "action": "RestartJob"} not in policies:
        problems.append("an evicted pod must restart the job")
    for task in spec["tasks"]:
        env = env_of(task["template"]["spec"]["containers"][0])
        pod_0 = f"{name}-{spec['tasks'][0]['name']}-0.{name}"
        if env.get("MASTER_ADDR") != pod_0 or env.get("NODES") != str(nodes):
            problems.append(f"{task['name']}: MASTER_ADDR and NODES must name pod 0 and count {nodes} nodes")
    return problems


def runtime_rules(runtime):
    """Trainer's: the trainer's job and container are both named `node`; PlainML is an mlPolicy with no
    framework policy, and the CRD's CEL rule allows one at most; the Job's index is each node's rank."""
    problems = []
    frameworks = set(runtime["spec"]["mlPolicy"]) - {"numNodes"}
    if frameworks:
        problems.append(f"PlainML has no framework policy, got {sorted(frameworks)}")
    # The CRD's x-kubernetes-validations rule, which the API server would enforce.
    if len(frameworks) > 1:
        problems.append("Only one of the policy can be configured")
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    node = next((job for job in jobs if job["name"] == "node"), None)
    if node is None:
        return problems + ["no replicated job named node"]
    if node["template"]["spec"].get("completionMode") != "Indexed":
        problems.append("the node job must be Indexed: JOB_COMPLETION_INDEX is the node's rank")
    if "node" not in [c["name"] for c in node["template"]["spec"]["template"]["spec"]["containers"]]:
        problems.append("no container named node")
    return problems


def trainjob_rules(trainjob, runtimes):
    name, trainer = trainjob["metadata"]["name"], trainjob["spec"]["trainer"]
    problems, env = [], {item["name"]: item.get("value") for item in trainer.get("env", [])}
    if trainjob["spec"]["runtimeRef"]["name"] not in runtimes:
        problems.append(f"runtimeRef {trainjob['spec']['runtimeRef']['name']} is not this file's runtime")
    wanted = str(trainer.get("numNodes")), f"{name}-node-0-0.{name}"
    if (env.get("NODES"), env.get("MASTER_ADDR")) != wanted:
        problems.append("NODES and MASTER_ADDR must follow numNodes and name pod 0 of the node job")
    return problems


def pod_templates(doc):
    if doc["kind"] == "AscendJob":
        return [spec["template"] for spec in doc["spec"]["replicaSpecs"].values()]
    if doc["kind"] == "Job":
        return [task["template"] for task in doc["spec"]["tasks"]]
    if doc["kind"] == "ClusterTrainingRuntime":
        jobs = doc["spec"]["template"]["spec"]["replicatedJobs"]
        return [job["template"]["spec"]["template"] for job in jobs]
    return []


def hardening(doc):
    """What the plain Jobs hold their pods to (and what checkov cannot see in these kinds): no root, no token,
    the default seccomp profile, no privilege escalation, a read-only root file system, no capabilities."""
    problems = []
    for template in pod_templates(doc):
        spec = template["spec"]
        no_token = spec.get("automountServiceAccountToken") is False
        if not (no_token and spec["securityContext"].get("runAsNonRoot")):
            problems.append("pods mount no service account token and run as non-root")
        if spec["securityContext"].get("seccompProfile") != {"type": "RuntimeDefault"}:
            problems.append("the RuntimeDefault seccomp profile")
        for container in spec["containers"]:
            context = container.get("securityContext", {})
            if (context.get("allowPrivilegeEscalation") is not False
                    or not context.get("readOnlyRootFilesystem")
                    or context.get("capabilities") != {"drop": ["ALL"]}):
                problems.append(f"{container['name']}: no escalation, a read-only root, no capabilities")
    return problems


def problems_of(docs):
    runtimes = {doc["metadata"]["name"] for doc in docs if doc["kind"] == "ClusterTrainingRuntime"}
    rules = {"AscendJob": ascendjob_rules, "Job": volcano_rules, "ClusterTrainingRuntime": runtime_rules,
             "TrainJob": lambda doc: trainjob_rules(doc, runtimes)}
    found = []
    for doc in docs:
        found += schema_errors(doc) + rules[doc["kind"]](doc) + hardening(doc)
    return found


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_manifest_validates_against_its_crd(manifest):
    docs = custom_resources(manifest)
    assert docs and [error for doc in docs for error in schema_errors(doc)] == []


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_manifest_keeps_its_operators_rules(manifest):
    assert problems_of(custom_resources(manifest)) == []


def pod(doc, rtype):
    """An AscendJob's pod spec of the replica type `rtype`."""
    return doc["spec"]["replicaSpecs"][rtype]["template"]["spec"]


def node_job(doc):
    """A ClusterTrainingRuntime's Job spec of its node job."""
    return doc["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]


def misspell(doc):
    pod(doc, "Worker")["containers"][0]["imagePulPolicy"] = "Always"


BROKEN = {  # manifest, how it is broken, what must be named
    "ascendjob-misspelt-field": ("k8s-ascendjob.yaml", misspell, "'imagePulPolicy' was unexpected"),
    "ascendjob-container-not-named-ascend": (
        "k8s-ascendjob.yaml",
        lambda doc: pod(doc, "Worker")["containers"][0].update(name="train"),
        "Worker: no container named ascend"),
    "ascendjob-two-schedulers": (
        "overlays/ascendjob-multinode",
        lambda doc: doc["spec"]["replicaSpecs"]["Scheduler"].update(replicas=2),
        "exactly one Scheduler replica"),
    "ascendjob-missing-gang-size": (
        "k8s-ascendjob.yaml", lambda doc: doc["spec"]["runPolicy"]["schedulingPolicy"].pop("minAvailable"),
        "the gang size minAvailable is None"),
    "ascendjob-no-npu": (
        "overlays/ascendjob-310p",
        lambda doc: pod(doc, "Worker")["containers"][0]["resources"].update(requests={"cpu": "8"}),
        "Worker: requests no NPU"),
    "ascendjob-port-renamed": (
        "k8s-ascendjob.yaml",
        lambda doc: pod(doc, "Scheduler")["containers"][0]["ports"][0].update(name="scheduler"),
        "Scheduler: no port named ascendjob-port"),
    "ascendjob-without-framework-label": (
        "k8s-ascendjob.yaml", lambda doc: doc["metadata"]["labels"].pop("framework"),
        "the label framework: mindspore is missing"),
    "ascendjob-restarted-on-any-failure": (
        "k8s-ascendjob.yaml",
        lambda doc: doc["spec"]["replicaSpecs"]["Worker"].update(restartPolicy="OnFailure"),
        "Worker: restartPolicy ExitCode"),
    "ascendjob-run-as-root": (
        "k8s-ascendjob.yaml",
        lambda doc: pod(doc, "Worker")["securityContext"].pop("runAsNonRoot"), "run as non-root"),
    "volcano-misspelt-field": ("k8s-volcano.yaml", lambda doc: doc["spec"].update(minAvaliable=2),
                               "'minAvaliable' was unexpected"),
    "volcano-missing-gang-size": ("k8s-volcano.yaml", lambda doc: doc["spec"].pop("minAvailable"),
                                  "the gang size minAvailable is None"),
    "volcano-failure-before-exit-codes": (
        "k8s-volcano.yaml", lambda doc: doc["spec"]["policies"].sort(key=lambda p: "exitCode" in p),
        "exit 2, 3 and 4 must abort the job before any PodFailed policy"),
    "volcano-eviction-not-restarting": (
        "k8s-volcano.yaml",
        lambda doc: doc["spec"]["policies"].remove({"event": "PodEvicted", "action": "RestartJob"}),
        "an evicted pod must restart the job"),
    "volcano-master-not-pod-0": (
        "k8s-volcano.yaml",
        lambda doc: pod_templates(doc)[0]["spec"]["containers"][0]["env"][2].update(
            value="fashion-mnist-volcano-node-1.fashion-mnist-volcano"),
        "MASTER_ADDR and NODES must name pod 0"),
    "volcano-without-svc": ("k8s-volcano.yaml", lambda doc: doc["spec"]["plugins"].pop("svc"),
                            "the svc and env plugins"),
    "trainer-misspelt-field": ("k8s-trainer.yaml", lambda doc: doc["spec"]["trainer"].update(numNode=2)
                               if doc["kind"] == "TrainJob" else None, "'numNode' was unexpected"),
    "trainer-container-renamed": (
        "k8s-trainer.yaml",
        lambda doc: node_job(doc)["template"]["spec"]["containers"][0].update(name="train")
        if doc["kind"] == "ClusterTrainingRuntime" else None,
        "no container named node"),
    "trainer-two-framework-policies": (
        "k8s-trainer.yaml", lambda doc: doc["spec"]["mlPolicy"].update(torch={}, mpi={})
        if doc["kind"] == "ClusterTrainingRuntime" else None, "Only one of the policy can be configured"),
    "trainer-node-job-not-indexed": (
        "k8s-trainer.yaml",
        lambda doc: node_job(doc).pop("completionMode") if doc["kind"] == "ClusterTrainingRuntime" else None,
        "the node job must be Indexed"),
    "trainer-another-runtime": ("k8s-trainer.yaml", lambda doc: doc["spec"]["runtimeRef"].update(
        name="torch-distributed") if doc["kind"] == "TrainJob" else None, "is not this file's runtime"),
    "trainer-nodes-unlike-numnodes": (
        "k8s-trainer.yaml",
        lambda doc: doc["spec"]["trainer"].update(numNodes=3) if doc["kind"] == "TrainJob" else None,
        "NODES and MASTER_ADDR must follow"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_copy_fails(case):
    manifest, breaking, named = BROKEN[case]
    docs = copy.deepcopy(custom_resources(manifest))
    for doc in docs:
        breaking(doc)
    found = problems_of(docs)
    assert any(named in problem for problem in found), found


def dry_run(env, tmp_path):
    """run.sh's msrun command under `env`, the paths as they are in the image."""
    env = job_env(DRY_RUN="1", OUTPUT_DIR=str(tmp_path / "outputs"), DATA_DIR=str(tmp_path / "data"), **env)
    result = subprocess.run([str(ROOT / "run.sh")], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().replace(str(ROOT), "/opt/job").replace(str(tmp_path), "/workspace")


# What each operator injects, from its own source, for the manifests' pods:
# - AscendJob: env.go, setMindSporeEnv: MS_SCHED_HOST (the Scheduler's own pod IP; the workers get its
#   Service's), MS_SCHED_PORT (the port named ascendjob-port), MS_LOCAL_WORKER (the NPUs a pod requests),
#   MS_WORKER_NUM (that times the pods with NPUs), MS_NODE_RANK (the replica index, +1 for Workers when the
#   Scheduler holds NPUs), MS_ROLE, and NPU_POD (whether this pod requests NPUs);
# - Volcano: the env plugin's VC_TASK_INDEX; the manifest's NODES and MASTER_ADDR;
# - Trainer: the Indexed Job's JOB_COMPLETION_INDEX; the TrainJob's NODES and MASTER_ADDR.
OPERATOR_ENV = {
    "ascendjob-scheduler": {"MS_SCHED_HOST": "10.0.0.5", "MS_SCHED_PORT": "2222", "MS_LOCAL_WORKER": "8",
                            "MS_WORKER_NUM": "16", "MS_NODE_RANK": "0", "MS_ROLE": "MS_SCHED",
                            "NPU_POD": "false"},
    "ascendjob-worker-1": {"MS_SCHED_HOST": "10.96.0.7", "MS_SCHED_PORT": "2222", "MS_LOCAL_WORKER": "8",
                           "MS_WORKER_NUM": "16", "MS_NODE_RANK": "1", "MS_ROLE": "MS_WORKER",
                           "NPU_POD": "true"},
    "volcano-node-1": {"NODES": "2", "WORKERS": "8", "MASTER_PORT": "8118", "VC_TASK_INDEX": "1",
                       "MASTER_ADDR": "fashion-mnist-volcano-node-0.fashion-mnist-volcano"},
    "trainer-node-1": {"NODES": "2", "WORKERS": "8", "MASTER_PORT": "8118", "JOB_COMPLETION_INDEX": "1",
                       "MASTER_ADDR": "fashion-mnist-lenet-node-0-0.fashion-mnist-lenet"},
}


@pytest.mark.parametrize("case", OPERATOR_ENV)
def test_run_sh_under_each_operator_runs_the_msrun_command_the_docs_give(case, tmp_path):
    command = dry_run(OPERATOR_ENV[case], tmp_path)
    documented = [line.strip() for line in (ROOT / "docs" / "deployment.md").read_text().splitlines()
                  if line.strip().startswith("msrun ")]
    assert command in documented, command
    assert shlex.split(command)[0] == "msrun"
