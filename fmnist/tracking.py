"""The job's MLflow run, driven from rank 0 without ever stalling training: parameters, metrics, datasets,
system metrics per node, artifacts, and the trained model as an MLflow model."""

import collections
import dataclasses
import hashlib
import itertools
import os
import queue
import threading
import time
import warnings
from pathlib import Path

import mindspore as ms

from . import common, serving
from .common import log

# MLflow retries a dead server for minutes by default; these bound one request to about half a minute.
# Its usage telemetry would be one more thread reaching for the internet from every training pod.
# System metrics every 10 s: one psutil sample and one request, under the benchmark's noise (README).
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
                   "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "10"}
# The UI's "Model training" view (not its GenAI one) for the job's experiment.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
MLFLOW_FINISH_TIMEOUT_S = 60
MLFLOW_STOP_TIMEOUT_S = 10  # what a stopped job waits for MLflow: the pod's 30 s grace period must hold it all
SERVING_EXAMPLE_IMAGES = 4  # test images stored with the MLflow model as its input example
PACKAGE_DIR = Path(__file__).resolve().parent
REQUIREMENTS = PACKAGE_DIR.parent / "requirements.txt"


def apply_mlflow_defaults():
    for name, value in MLFLOW_DEFAULTS.items():
        os.environ.setdefault(name, value)  # a user's setting wins


def experiment_id(client, name):
    """The id of the experiment `name`, created as a model-development experiment if it does not exist."""
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(name, tags=EXPERIMENT_TAGS)
    for key, value in EXPERIMENT_TAGS.items():
        if key not in found.tags:  # a kind the user chose stays
            client.set_experiment_tag(found.experiment_id, key, value)
    return found.experiment_id


def run_exists(client, run_id):
    """Whether the tracking store has the run: a checkpoint's run may live in another store."""
    from mlflow.exceptions import MlflowException  # pylint: disable=import-outside-toplevel
    try:
        client.get_run(run_id)
        return True
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise  # a server that cannot answer is a tracking failure, not a missing run
        return False


def run_page(tracking_uri, experiment, run_id):
    """Where a user sees the run: its page in the UI of a tracking server, in the UI's model-training view
    (a fresh browser opens MLflow 3's GenAI view whatever the experiment's kind); else the tracking URI."""
    if not tracking_uri.startswith(("http://", "https://")):
        return tracking_uri
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"


def log_served_model(mlflow, client, payload):
    """Log the exported MindIR as the run's MLflow model `model` (pyfunc, loaded by serving._load_pyfunc), with
    its signature, an input example of real test images and the job's pinned requirements; register it when
    asked, tagged with the test accuracy. Runs on the tracker's thread, inside the run."""
    signature, example = serving.served_signature(payload["example"], payload["predictions"])
    info = mlflow.pyfunc.log_model(
        name="model", loader_module=serving.__name__, data_path=payload["mindir"],
        code_paths=[str(PACKAGE_DIR)], signature=signature, input_example=example,
        pip_requirements=str(REQUIREMENTS),
        registered_model_name=payload["register_as"] or None, await_registration_for=MLFLOW_FINISH_TIMEOUT_S)
    if payload["register_as"]:
        client.set_model_version_tag(payload["register_as"], info.registered_model_version, "test_accuracy",
                                     f"{payload['test_accuracy']:.4f}")
        log.info("MLflow: registered model %s version %s", payload["register_as"], info.registered_model_version)


class NullTracker:
    """Tracking on ranks other than 0, or when switched off: accepts everything, records nothing."""

    run_id = None

    def log_metrics(self, metrics, step):
        pass

    def log_artifact(self, path):
        pass

    def log_model(self, mindir, example, predictions, register_as, test_accuracy):
        pass

    def run_id_within(self, timeout):
        return None

    def finish(self, status, timeout=None):
        pass


class MlflowTracker(NullTracker):
    """The job's one MLflow run, driven from rank 0 by a background thread.

    Training never waits for tracking: connecting, creating the run and every request happen on the thread,
    metrics queued between two requests go out as one batch, and the first failure (server down at start
    or gone mid-run) turns tracking off with one warning instead of failing or stalling the job. finish()
    waits a bounded time and says what was not logged. The run is MLflow's own kind: started with
    mlflow.start_run, whose context providers add the user, the source and its git commit; it holds the
    datasets, this node's system metrics and, at the end, the model as an MLflow model.

    MLflow's own asynchronous logging (synchronous=False) queues metric batches on a thread too, but creating
    the run, logging the datasets and the model stay synchronous, and a failed request surfaces only at its
    flush; one thread of the job's own carries all of it, so the start never blocks, the finish is bounded,
    and what was not logged is counted.
    """

    def __init__(self, experiment, run_name, params, tags, resume_run_id=None, datasets=(), node="node0",
                 finish_timeout=MLFLOW_FINISH_TIMEOUT_S):
        apply_mlflow_defaults()
        self._finish_timeout = finish_timeout
        self._queue = queue.SimpleQueue()
        self._not_logged = collections.Counter()
        self._error = None
        self._connected = threading.Event()  # set once the run exists or starting it failed
        self._run_id = None
        self._thread = threading.Thread(target=self._work, name="mlflow-tracker", daemon=True,
                                        args=(experiment, run_name, params, tags, resume_run_id, datasets, node))
        self._thread.start()

    @property
    def run_id(self):
        """The run's id once it exists; None if starting it failed or takes longer than the finish bound."""
        return self.run_id_within(self._finish_timeout)

    def run_id_within(self, timeout):
        self._connected.wait(timeout)
        return self._run_id

    def log_metrics(self, metrics, step):
        self._queue.put(("metrics", (dict(metrics), step, int(time.time() * 1000))))

    def log_artifact(self, path):
        self._queue.put(("artifact", str(path)))

    def log_model(self, mindir, example, predictions, register_as, test_accuracy):
        self._queue.put(("model", {"mindir": str(mindir), "example": example, "predictions": predictions,
                                   "register_as": register_as, "test_accuracy": test_accuracy}))

    def finish(self, status, timeout=None):
        timeout = timeout or self._finish_timeout
        self._queue.put(("end", status))
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._fail(TimeoutError(f"no answer within {timeout:.0f} s"), "finishing the run")
            while not self._queue.empty():
                kind, payload = self._queue.get()
                self._count_not_logged(kind, [payload])
        if self._not_logged:
            what = ", ".join(f"{n} {kind}" for kind, n in sorted(self._not_logged.items()))
            log.warning("MLflow: not logged: %s (tracking failed: %s)", what, self._error)

    def _work(self, experiment, run_name, params, tags, resume_run_id, datasets, node):
        import mlflow  # pylint: disable=import-outside-toplevel
        from mlflow.entities import Metric as MlflowMetric  # pylint: disable=import-outside-toplevel
        from mlflow.system_metrics.system_metrics_monitor import (  # pylint: disable=import-outside-toplevel
            SystemMetricsMonitor)
        system_metrics = None
        try:
            client = mlflow.MlflowClient()
            if resume_run_id and not run_exists(client, resume_run_id):
                log.warning("MLflow: the checkpoint's run %s is not at %s (another tracking store); continuing "
                            "in a new run there, tagged resumed_from_run; the earlier epochs stay in the old one",
                            resume_run_id, mlflow.get_tracking_uri())
                tags, resume_run_id = {**tags, "resumed_from_run": resume_run_id}, None
            if resume_run_id:  # a resumed job continues its run; parameters and datasets are already there
                run = mlflow.start_run(run_id=resume_run_id, log_system_metrics=False)
                client.set_tag(resume_run_id, "resumed", "true")
            else:
                run = mlflow.start_run(experiment_id=experiment_id(client, experiment), run_name=run_name or None,
                                       tags=tags, log_system_metrics=False)
                client.log_batch(run.info.run_id, params=[mlflow.entities.Param(k, str(v)) for k, v in params.items()])
                for context, (images, labels, name, digest, source) in datasets:
                    with warnings.catch_warnings():  # that a local path could be one of two kinds of local source
                        warnings.simplefilter("ignore", UserWarning)
                        dataset = mlflow.data.from_numpy(images, targets=labels, source=source, name=name, digest=digest)
                    mlflow.log_input(dataset, context=context)
            self._run_id = run.info.run_id
            system_metrics = SystemMetricsMonitor(self._run_id, node_id=node)
            system_metrics.start()
            log.info("MLflow: run %s in experiment '%s' at %s", self._run_id, experiment,
                     run_page(mlflow.get_tracking_uri(), run.info.experiment_id, self._run_id))
        except Exception as exc:  # pylint: disable=broad-except
            self._fail(exc, f"starting a run at {mlflow.get_tracking_uri()}")
        self._connected.set()
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get())
            # Consecutive metric items become one request; order with artifacts and the end is kept.
            for kind, group in itertools.groupby(items, key=lambda item: item[0]):
                payloads = [payload for _, payload in group]
                if kind == "end":
                    if system_metrics:
                        system_metrics.finish()
                    if self._error is None:
                        self._attempt(lambda: mlflow.end_run(payloads[0]), "ending the run", "run end")
                    return
                if self._error is not None:
                    self._count_not_logged(kind, payloads)
                elif kind == "artifact":
                    for path in payloads:
                        self._attempt(lambda p=path: client.log_artifact(self._run_id, p), f"logging {path}",
                                      "artifacts")
                elif kind == "model":
                    self._attempt(lambda: log_served_model(mlflow, client, payloads[0]), "logging the model", "model")
                else:
                    metrics = [MlflowMetric(k, float(v), ts, step)
                               for values, step, ts in payloads for k, v in values.items()]
                    self._attempt(lambda m=metrics: client.log_batch(self._run_id, metrics=m), "logging metrics",
                                  "metric values", count=len(metrics))

    def _count_not_logged(self, kind, payloads):
        if kind == "metrics":
            self._not_logged["metric values"] += sum(len(values) for values, _, _ in payloads)
        elif kind == "artifact":
            self._not_logged["artifacts"] += len(payloads)
        elif kind == "model":
            self._not_logged["model"] += 1

    def _attempt(self, action, what, kind, count=1):
        try:
            action()
        except Exception as exc:  # pylint: disable=broad-except
            self._not_logged[kind] += count
            self._fail(exc, what)

    def _fail(self, exc, what):
        if self._error is None:
            self._error = f"{what}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            log.warning("MLflow: tracking is off for the rest of the job after a failure %s; training goes on",
                        self._error)

def start_tracking(cfg, resolved, resume_run_id, datasets, node):
    """The job's MLflow run: every setting and what the job resolved them to (device, world size, amp level,
    loss scaling, ...), as parameters; tags to filter runs by."""
    params = {**dataclasses.asdict(cfg), **resolved, "global_batch_size": cfg.batch_size * resolved["world_size"],
              "mindspore_version": ms.__version__, "job_version": common.JOB_VERSION}
    tags = {"device": resolved["device"], "world_size": str(resolved["world_size"]), "job_version": common.JOB_VERSION}
    if os.environ.get("GIT_COMMIT"):  # an image has no .git for MLflow's git context to read; its build says
        tags["mlflow.source.git.commit"] = os.environ["GIT_COMMIT"]
    return MlflowTracker(cfg.experiment, cfg.run_name, params, tags, resume_run_id=resume_run_id, datasets=datasets,
                         node=node)


def dataset_inputs(splits, checksums, sources):
    """The train and test splits as MLflow dataset inputs: (context, (images, labels, name, digest, source)).
    The digest comes from the pinned SHA-256 of the content, so equal digests mean equal data."""
    inputs = []
    for context, split, (images, labels) in (("training", "train", splits[0]), ("evaluation", "t10k", splits[1])):
        names = [f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"]
        digest = hashlib.sha256("".join(checksums[n] for n in names).encode()).hexdigest()[:32]
        inputs.append((context, (images, labels, f"fashion-mnist-{split}", digest, sources.get(names[0], ""))))
    return inputs


def node_name(environ=os.environ):
    """This node in system-metric names: node0, node1, ... (run.sh exports NODE_RANK)."""
    return f"node{environ.get('NODE_RANK', '0')}"


def watch_node(collective, tracker, world_size, local_workers):
    """Start MLflow's system-metrics monitor on this node's first worker for the nodes after the first, whose
    monitor rank 0's tracker runs. Returns the monitor or None. A collective: every rank calls it."""
    if world_size <= local_workers:
        return None  # one node: rank 0's tracker watches it
    run_id = collective.broadcast_text(tracker.run_id_within(MLFLOW_STOP_TIMEOUT_S) if collective.is_main else "")
    if not run_id or collective.is_main or not collective.is_local_main:
        return None
    from mlflow.system_metrics.system_metrics_monitor import (  # pylint: disable=import-outside-toplevel
        SystemMetricsMonitor)
    apply_mlflow_defaults()
    monitor = SystemMetricsMonitor(run_id, node_id=node_name())
    monitor.start()
    return monitor


