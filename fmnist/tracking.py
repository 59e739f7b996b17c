"""The job's MLflow run, driven from rank 0 without ever stalling training: parameters, metrics, datasets,
system metrics per node, artifacts, and the trained model as an MLflow model."""

import collections
import dataclasses
import hashlib
import json
import logging
import os
import sys
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
PENDING_FILE = "mlflow-pending.jsonl"  # in the output directory: what the server did not take before the end
BUFFER_LIMIT = 100_000  # metric values and operations held in memory while the server is away; older ones: on disk
RETRY_DELAYS_S = (1, 2, 4, 8, 15, 30)  # between attempts while the server is away; then every 30 s
MLFLOW_START_WAIT_S = 15  # what training waits for the run to exist (a server that does not answer)
MLFLOW_STOP_TIMEOUT_S = 10  # what a stopped job waits for MLflow: the pod's 30 s grace period must hold it all
SERVING_EXAMPLE_IMAGES = 4  # test images stored with the MLflow model as its input example
PACKAGE_DIR = Path(__file__).resolve().parent
REQUIREMENTS = PACKAGE_DIR.parent / "requirements.txt"


def apply_mlflow_defaults():
    for name, value in MLFLOW_DEFAULTS.items():
        os.environ.setdefault(name, value)  # a user's setting wins
    # urllib3 logs each retry of an unreachable server; the job's own line says so once.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


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


def transient(exc):
    """Whether a failed request may succeed later: the server was unreachable, timed out or answered 5xx or 429.
    A request it refused (4xx) or a file that is gone fails the same way every time."""
    from mlflow.exceptions import RestException  # pylint: disable=import-outside-toplevel
    if isinstance(exc, RestException):
        return exc.get_http_status_code() >= 500 or exc.get_http_status_code() == 429
    return not isinstance(exc, (FileNotFoundError, IsADirectoryError, ValueError, TypeError, KeyError))


def describe(exc):
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class Sender:
    """Carries the job's tracking operations to MLflow, one at a time and in order. An operation is
    (kind, payload), JSON-serializable so that what could not be sent can wait in the output directory:
      run      the run the next operations belong to (its id)
      start    create the run, or continue a resumed job's, with parameters, tags and datasets
      metrics  [values, step, timestamp] lists, sent as one batch
      artifact a file's path
      model    the exported model to log as the run's MLflow model
      end      the run's final status"""

    def __init__(self):
        import mlflow  # pylint: disable=import-outside-toplevel
        self.mlflow, self.client, self.run_id = mlflow, mlflow.MlflowClient(), None
        self.experiment_id = None

    def send(self, kind, payload):
        from mlflow.entities import Metric  # pylint: disable=import-outside-toplevel
        if kind == "run":
            self.run_id = payload
        elif kind == "start":
            self.run_id = self._start(**payload)
        elif kind == "metrics":
            self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, step)
                                                        for values, step, ts in payload for k, v in values.items()])
        elif kind == "artifact":
            self.client.log_artifact(self.run_id, payload)
        elif kind == "model":
            with self.mlflow.start_run(run_id=self.run_id, log_system_metrics=False):
                log_served_model(self.mlflow, self.client, payload)
        elif kind == "end":
            self.client.set_terminated(self.run_id, payload)

    def _start(self, experiment, run_name, params, tags, resume_run_id, datasets, attempt=None):
        del attempt  # the tracker's own mark of which start of the job this is
        from mlflow.entities import Dataset, DatasetInput, InputTag, Param  # pylint: disable=import-outside-toplevel
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT  # pylint: disable=import-outside-toplevel
        if resume_run_id and not run_exists(self.client, resume_run_id):
            log.warning("MLflow: the checkpoint's run %s is not at %s (another tracking store); continuing in a new "
                        "run there, tagged resumed_from_run; the earlier epochs stay in the old one",
                        resume_run_id, self.mlflow.get_tracking_uri())
            tags, resume_run_id = {**tags, "resumed_from_run": resume_run_id}, None
        if resume_run_id:  # a resumed job continues its run; parameters and datasets are already there
            self.client.update_run(resume_run_id, status="RUNNING")
            self.client.set_tag(resume_run_id, "resumed", "true")
            self.experiment_id = self.client.get_run(resume_run_id).info.experiment_id
            return resume_run_id
        self.experiment_id = experiment_id(self.client, experiment)
        run = self.client.create_run(self.experiment_id, tags=tags, run_name=run_name or None)
        run_id = run.info.run_id
        self.client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
        self.client.log_inputs(run_id, [DatasetInput(Dataset(**entity), [InputTag(MLFLOW_DATASET_CONTEXT, context)])
                                        for context, entity in datasets])
        return run_id


def dataset_entities(datasets):
    """The datasets as MLflow's dataset entities (name, digest, source, schema, profile), computed from the
    arrays here so that a run created later, from the output directory, gets the same."""
    import mlflow  # pylint: disable=import-outside-toplevel
    entities = []
    for context, (images, labels, name, digest, source) in datasets:
        with warnings.catch_warnings():  # that a local path could be one of two kinds of local source
            warnings.simplefilter("ignore", UserWarning)
            dataset = mlflow.data.from_numpy(images, targets=labels, source=source, name=name, digest=digest)
        entity = dataset._to_mlflow_entity()  # pylint: disable=protected-access
        entities.append((context, {field: getattr(entity, field)
                                   for field in ("name", "digest", "source_type", "source", "schema", "profile")}))
    return entities


def as_json(kind, payload):
    """An operation as one line of the pending file (arrays and frames as lists)."""
    if kind == "model":
        payload = {**payload, "predictions": payload["predictions"].to_dict(orient="list")}
    return json.dumps([kind, payload], default=lambda value: value.tolist())  # NumPy's arrays and scalars


def from_json(line):
    import numpy as np  # pylint: disable=import-outside-toplevel
    import pandas as pd  # pylint: disable=import-outside-toplevel
    kind, payload = json.loads(line)
    if kind == "model":
        payload = {**payload, "example": np.asarray(payload["example"], dtype=np.uint8),
                   "predictions": pd.DataFrame(payload["predictions"])}
    if kind == "metrics":
        payload = [tuple(item) for item in payload]
    return kind, payload


def read_pending(output_dir):
    path = Path(output_dir) / PENDING_FILE
    return [from_json(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def write_pending(output_dir, operations):
    """What was not sent, whole or not at all; none: no file."""
    path = Path(output_dir) / PENDING_FILE
    if operations:
        common.write_atomic(path, "".join(as_json(*op) + "\n" for op in operations).encode())
    else:
        path.unlink(missing_ok=True)


class Backlog:
    """The operations not sent yet, oldest first: at most `limit` metric values and other operations in
    memory; past that the memory's content goes, in order, to the end of PENDING_FILE, which is read before the
    memory. What an earlier start of the job left there is read first. Not thread-safe: the tracker's lock
    guards it."""

    def __init__(self, output_dir, limit):
        self.path, self.limit = Path(output_dir) / PENDING_FILE, limit
        self.memory, self.in_memory = collections.deque(), 0
        self.on_disk = 0  # operations in the file not read yet: what an earlier start left
        if self.path.exists():
            with open(self.path, encoding="utf-8") as pending:
                self.on_disk = sum(1 for line in pending if line.strip())
        self.reader = None
        self.current, self.from_disk = None, False  # the oldest operation, being sent, and where it came from

    def put(self, kind, payload):
        if kind == "metrics" and self.memory and self.memory[-1][0] == "metrics":
            self.memory[-1] = ("metrics", self.memory[-1][1] + payload)  # waiting anyway: one batch
        else:
            self.memory.append((kind, payload))
        self.in_memory += count(kind, payload)
        if self.in_memory >= self.limit:  # rare: a long outage; one write, on the caller's thread
            with open(self.path, "a", encoding="utf-8") as out:
                out.writelines(as_json(*op) + "\n" for op in self.memory)
            self.on_disk += len(self.memory)
            self.memory.clear()
            self.in_memory = 0
            log.warning("MLflow: %d metric values and operations wait for the server; the older ones now wait in "
                        "%s", self.limit, self.path)

    def oldest(self):
        """The oldest operation (the one being sent until done() says otherwise), or None."""
        if self.current is None:
            if self.on_disk:  # the file stays open at its place: a spill appends behind it
                self.reader = self.reader or open(self.path, encoding="utf-8")  # noqa: SIM115
                self.current, self.on_disk, self.from_disk = from_json(self.reader.readline()), self.on_disk - 1, True
            elif self.memory:
                self.current, self.from_disk = self.memory.popleft(), False
                self.in_memory -= count(*self.current)
        return self.current

    def done(self, sent):
        """The oldest operation went out, or its first `sent` metric points did."""
        kind, payload = self.current
        self.current = ("metrics", payload[len(sent):]) if kind == "metrics" and len(sent) < len(payload) else None
        if self.current is None and self.from_disk and not self.on_disk:  # the file's last operation
            self.reader.close()
            self.reader = None
            self.path.unlink(missing_ok=True)

    def unsent(self):
        pending = [self.current] if self.current else []
        if self.on_disk:
            self.reader = self.reader or open(self.path, encoding="utf-8")  # noqa: SIM115
            pending += [from_json(line) for line in self.reader if line.strip()]
        if self.reader:
            self.reader.close()
        return pending + list(self.memory)


class MlflowTracker(NullTracker):
    """The job's one MLflow run, driven from rank 0 by a background thread.

    Training waits for tracking only at its start, for the run's creation (start_tracking, MLFLOW_START_WAIT_S
    at most); every request happens on the thread, in the order the job made them, and metrics queued between
    two requests go out as one batch. When the server cannot be reached (down at start, restarted, a network
    blip), the operations wait in a Backlog and the thread retries with backoff; when the server answers again
    they go out in order, and nothing is lost. The backlog keeps BUFFER_LIMIT metric values and operations in
    memory, and the older ones beyond that in PENDING_FILE. finish() waits a bounded time; then what was not
    sent goes to PENDING_FILE in the output directory, with one line saying so, and the next start there (or
    `python -m fmnist.tracking OUTPUT_DIR`) sends it first, the run's final status last. A request the server
    refuses (4xx) is not retried: it is counted as not logged.

    The run carries MLflow's own system tags (its context providers: user, source, git commit, resolved in the
    job's process), the datasets, this node's system metrics and, at the end, the model as an MLflow model.
    MLflow's asynchronous logging (synchronous=False) queues metric batches on a thread too, but creating the
    run, logging the datasets and the model stay synchronous, and it keeps nothing across an outage; one
    thread of the job's own carries all of it in order.
    """

    def __init__(self, experiment, run_name, params, tags, output_dir, resume_run_id=None, datasets=(),
                 node="node0", finish_timeout=MLFLOW_FINISH_TIMEOUT_S, buffer_limit=BUFFER_LIMIT):
        apply_mlflow_defaults()
        self._finish_timeout = finish_timeout
        self._output_dir = Path(output_dir)
        self._changed = threading.Condition()  # guards the backlog
        self._backlog = Backlog(output_dir, buffer_limit)
        self._stopped = threading.Event()
        self._not_logged = collections.Counter()
        self._connected = threading.Event()  # set once this job's run exists or starting it failed once
        self._run_id = None
        self._sender = None
        # This job's start: after what an earlier start left, before anything of this job's. Made sendable (its
        # tags and datasets resolved) on the thread; `attempt` tells it apart from an earlier start's.
        self._attempt = os.urandom(8).hex()
        start = {"experiment": experiment, "run_name": run_name, "params": params, "tags": tags,
                 "resume_run_id": resume_run_id, "datasets": datasets, "attempt": self._attempt}
        self._backlog.put("start", start)
        self._thread = threading.Thread(target=self._work, name="mlflow-tracker", daemon=True, args=(start, node))
        self._thread.start()

    @property
    def run_id(self):
        """The run's id once it exists; None if starting it failed or takes longer than the finish bound."""
        return self.run_id_within(self._finish_timeout)

    def run_id_within(self, timeout):
        self._connected.wait(timeout)
        return self._run_id

    def log_metrics(self, metrics, step):
        self._put("metrics", [(dict(metrics), step, int(time.time() * 1000))])

    def log_artifact(self, path):
        self._put("artifact", str(path))

    def log_model(self, mindir, example, predictions, register_as, test_accuracy):
        self._put("model", {"mindir": str(mindir), "example": example, "predictions": predictions,
                            "register_as": register_as, "test_accuracy": test_accuracy})

    def finish(self, status, timeout=None):
        timeout = timeout or self._finish_timeout
        self._put("end", status)
        self._thread.join(timeout)
        if self._thread.is_alive():  # the server is away: what it did not take waits in the output directory
            self._stopped.set()
            with self._changed:
                held = self._backlog.unsent()
                run = [("run", self._sender.run_id)] if self._sender and self._sender.run_id else []
                write_pending(self._output_dir, run + held)
                self._changed.notify()
            log.warning("MLflow: the server did not answer within %.0f s; %s wait in %s: the next start with this "
                        "output directory sends them, or `python -m fmnist.tracking %s`", timeout,
                        summarize(held), self._output_dir / PENDING_FILE, self._output_dir)
        if self._not_logged:
            what = ", ".join(f"{n} {kind}" for kind, n in sorted(self._not_logged.items()))
            log.warning("MLflow: not logged: %s (the server refused them)", what)

    def _put(self, kind, payload):
        with self._changed:
            self._backlog.put(kind, payload)
            self._changed.notify()

    def _work(self, start, node):
        from mlflow.system_metrics.system_metrics_monitor import (  # pylint: disable=import-outside-toplevel
            SystemMetricsMonitor)
        import mlflow  # pylint: disable=import-outside-toplevel
        tags = mlflow.tracking.context.registry.resolve_tags(start["tags"])  # as where the job runs
        datasets = dataset_entities(start["datasets"])
        with self._changed:  # finish() may write it out meanwhile; computed outside, so log_metrics never waits
            start["tags"], start["datasets"] = tags, datasets
        system_metrics = None
        self._sender = Sender()
        failures = 0
        while True:
            with self._changed:
                while not self._stopped.is_set() and self._backlog.oldest() is None:
                    self._changed.wait()
                if self._stopped.is_set():
                    return
                kind, payload = self._backlog.oldest()
            if kind == "metrics":  # MLflow takes 1000 values a request
                payload = payload[:max(1, 1000 // max(1, len(payload[0][0])))]
            try:
                self._sender.send(kind, payload)
            except Exception as exc:  # pylint: disable=broad-except
                self._connected.set()  # nobody waits for a run that is not there
                if transient(exc):
                    failures += 1
                    if failures == 1:
                        log.warning("MLflow: cannot reach %s (%s); the job's tracking waits and is retried; "
                                    "training goes on", mlflow.get_tracking_uri(), describe(exc))
                    self._stopped.wait(RETRY_DELAYS_S[min(failures, len(RETRY_DELAYS_S)) - 1])
                    continue
                self._not_logged[kind if kind != "metrics" else "metric values"] += count(kind, payload)
                log.warning("MLflow: %s not logged: %s", kind, describe(exc))
            if failures:
                log.info("MLflow: %s answers again; sending what waited", mlflow.get_tracking_uri())
                failures = 0
            with self._changed:
                self._backlog.done(payload)
                finished = kind == "end" and self._backlog.oldest() is None
            if kind == "start" and payload.get("attempt") == self._attempt:
                self._run_id = self._sender.run_id
                self._connected.set()
                system_metrics = SystemMetricsMonitor(self._run_id, node_id=node)
                system_metrics.start()
                log.info("MLflow: run %s in experiment '%s' at %s", self._run_id, start["experiment"],
                         run_page(mlflow.get_tracking_uri(), self._sender.experiment_id, self._run_id))
            if finished:
                if system_metrics:
                    system_metrics.finish()
                return


def count(kind, payload):
    return sum(len(values) for values, _, _ in payload) if kind == "metrics" else 1


def summarize(operations):
    """What a list of operations holds, for a user: "12 metric values, 3 artifacts, the model and the run's end"."""
    counts = collections.Counter()
    for kind, payload in operations:
        counts[kind] += count(kind, payload)
    parts = [f"{counts[k]} {name}" for k, name in (("metrics", "metric values"), ("artifact", "artifacts"))
             if counts[k]]
    parts += [name for k, name in (("start", "the run's start"), ("model", "the model"), ("end", "the run's end"))
              if counts[k]]
    return " and ".join(filter(None, [", ".join(parts[:-1]), parts[-1]])) if parts else "nothing"


def send_pending(output_dir, timeout):
    """`python -m fmnist.tracking OUTPUT_DIR`: send what a job left in PENDING_FILE, retrying for `timeout`
    seconds. Returns the exit status: 0 when all was sent (the file is gone), 1 when the server stayed away
    (the file keeps what is left)."""
    apply_mlflow_defaults()
    operations = read_pending(output_dir)
    if not operations:
        print(f"{output_dir}: nothing waits for MLflow")
        return 0
    sender, sent, deadline = Sender(), 0, time.monotonic() + timeout
    while sent < len(operations):
        kind, payload = operations[sent]
        try:
            sender.send(kind, payload)
        except Exception as exc:  # pylint: disable=broad-except
            if transient(exc) and time.monotonic() < deadline:
                time.sleep(RETRY_DELAYS_S[0])
                continue
            if transient(exc):
                write_pending(output_dir, [("run", sender.run_id)] * bool(sender.run_id) + operations[sent:])
                print(f"MLflow at {sender.mlflow.get_tracking_uri()} did not answer ({describe(exc)}); "
                      f"{summarize(operations[sent:])} still wait in {Path(output_dir) / PENDING_FILE}",
                      file=sys.stderr)
                return 1
            print(f"MLflow refused {kind}: {describe(exc)}", file=sys.stderr)
        sent += 1
    write_pending(output_dir, [])
    print(f"MLflow: sent {summarize(operations)} to run {sender.run_id} at {sender.mlflow.get_tracking_uri()}")
    return 0


def start_tracking(cfg, resolved, resume_run_id, datasets, node):
    """The job's MLflow run: every setting and what the job resolved them to (device, world size, amp level,
    loss scaling, ...), as parameters; tags to filter runs by."""
    params = {**dataclasses.asdict(cfg), **resolved, "global_batch_size": cfg.batch_size * resolved["world_size"],
              "mindspore_version": ms.__version__, "job_version": common.JOB_VERSION}
    tags = {"device": resolved["device"], "world_size": str(resolved["world_size"]), "job_version": common.JOB_VERSION}
    if os.environ.get("GIT_COMMIT"):  # an image has no .git for MLflow's git context to read; its build says
        tags["mlflow.source.git.commit"] = os.environ["GIT_COMMIT"]
    tracker = MlflowTracker(cfg.experiment, cfg.run_name, params, tags, cfg.output_dir, resume_run_id=resume_run_id,
                            datasets=datasets, node=node, finish_timeout=cfg.tracking_wait)
    # Training starts once the run exists, or the server failed to answer once, or MLFLOW_START_WAIT_S passed:
    # MLflow's import and the run's creation take seconds of CPU (a new database's set-up among them), which
    # during the first epoch shared its core and interpreter and slowed it by a quarter or more.
    tracker.run_id_within(MLFLOW_START_WAIT_S)
    return tracker


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




def main(argv=None):
    """Send what a job's output directory holds for MLflow (the job does it at its next start anyway)."""
    import argparse  # pylint: disable=import-outside-toplevel
    parser = argparse.ArgumentParser(prog="python -m fmnist.tracking", description=main.__doc__)
    parser.add_argument("output_dir", type=Path, help="the job's --output-dir")
    parser.add_argument("--timeout", type=float, default=MLFLOW_FINISH_TIMEOUT_S,
                        help="seconds to keep retrying an unreachable server (default %(default)s)")
    args = parser.parse_args(argv)
    common.configure_logging(0)
    holder = common.output_dir_holder(args.output_dir)
    if holder:  # that job sends it itself
        parser.exit(common.EXIT_USAGE, f"python -m fmnist.tracking: {common.in_use(args.output_dir, holder)}\n")
    return send_pending(args.output_dir, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
