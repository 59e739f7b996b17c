"""Every MLflow call: rank 0 journals each operation in the output directory, and one sender carries the
journal to MLflow as the job runs, or later as `python -m fmnist.tracking sync` (docs/tracking.md)."""

import argparse
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from . import common, data
from .common import log

JOURNAL, POSITION = "mlflow-journal.jsonl", "mlflow-journal.position"
# MLflow retries a dead server for minutes, where the sender retries on its own; its telemetry would reach for
# the internet from every training pod.
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}  # the UI's "Model training" view
RETRY_DELAYS_S = (1, 2, 4, 8, 15, 30)
MAX_METRICS = 1000  # a log_batch request's limit
START_WAIT_S = 15  # what training waits for the run's creation to be tried
STOP_TIMEOUT_S = 10  # what a stopped job waits for MLflow: a pod's 30 s grace period must hold it all
PACKAGE_DIR = Path(__file__).resolve().parent
SERVING_MODULE = "fmnist.serving"  # by name: importing it would load MindSpore here


def transient(exc):
    """Worth retrying: unreachable, timed out, 429 or 5xx, or a local store another process holds or is making
    (SQLite's lock, or a race in MLflow's migrations: SQLAlchemy's and Alembic's errors)."""
    from alembic.util.exc import CommandError
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import OperationalError
    if isinstance(exc, MlflowException):
        return exc.get_http_status_code() in (429, *range(500, 600))
    return (isinstance(exc, (ConnectionError, TimeoutError, OperationalError, CommandError))
            or type(exc).__module__.startswith("requests"))


class Journal:
    """An append-only file of JSON lines, each written whole; read back from any byte offset."""

    def __init__(self, path):
        self.path, self.appended = Path(path), threading.Condition()
        self.size_before = None  # this process's first line's offset, for a rollback

    def append(self, op, **fields):
        """One line, whole or not at all: a full volume's part of it is taken back."""
        line = (json.dumps({"op": op, **fields}) + "\n").encode()
        # Unbuffered, so that nothing of a refused write is left to flush at the close.
        with self.appended, common.catch_full_disk(self.path), open(self.path, "a+b", buffering=0) as out:
            if self.size_before is None:
                self.size_before = self.drop_torn_line(out)
            end, rest = out.seek(0, os.SEEK_END), memoryview(line)
            try:
                while rest:
                    rest = rest[out.write(rest):]
            except OSError:
                out.truncate(end)
                raise
            self.appended.notify_all()

    def drop_torn_line(self, out):
        """The journal's size without a last line a killed job left cut short: a line appended after it would
        join it into one that no JSON reader takes."""
        size = out.seek(0, os.SEEK_END)
        out.seek(max(size - 1, 0))
        if out.read(1) in (b"", b"\n"):
            return size
        out.seek(0)
        whole = out.read().rfind(b"\n") + 1
        out.truncate(whole)
        log.warning("MLflow: the journal's last line was cut short (a job killed while writing it); its %d "
                    "bytes dropped", size - whole)
        return whole

    def last_steps(self):
        """Each metric's newest step since the training's first start: what a stopped job journaled."""
        steps = {}
        for _, op in self.read_from(0):
            if op["op"] == "start" and not op["continues"]:
                steps = {}
            elif op["op"] == "metrics":
                steps.update({key: max(op["step"], steps.get(key, -1)) for key in op["values"]})
        return steps

    def rollback(self):
        """Remove what this process appended."""
        if self.size_before is not None:
            os.truncate(self.path, self.size_before)

    def read_from(self, offset):
        """(offset after it, object) for each whole line after `offset`: a part line is being written."""
        lines = []
        if self.path.exists():
            with open(self.path, "rb") as journal:
                journal.seek(offset)
                for line in (line for line in journal if line.endswith(b"\n")):
                    offset += len(line)
                    lines.append((offset, json.loads(line)))
        return lines


def batch(pending):
    """The first operation of `pending` and how many lines it takes: metric lines in a row are one request."""
    first = pending[0][1]
    if first["op"] != "metrics":
        return first, 1
    points = []
    for count, (_, op) in enumerate(pending):
        if op["op"] != "metrics" or count and len(points) + len(op["values"]) > MAX_METRICS:
            return {"op": "metrics", "points": points}, count
        points += [(key, value, op["timestamp"], op["step"]) for key, value in op["values"].items()]
    return {"op": "metrics", "points": points}, len(pending)


class Sender:
    """Sends a journal in order from the recorded position, which moves (with the run's id) only past what
    MLflow took. A transient failure is retried; a refused start is bad input; after any other, it waits."""

    def __init__(self, output_dir):
        import mlflow
        os.environ.update({name: value for name, value in MLFLOW_DEFAULTS.items() if name not in os.environ})
        # The sender's own warning says what urllib3 would say of every retry.
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        self.journal, self.position = Path(output_dir) / JOURNAL, Path(output_dir) / POSITION
        state = json.loads(self.position.read_text()) if self.position.exists() else {}
        self.offset, self.run_id = state.get("offset", 0), state.get("run_id")
        self.mlflow, self.uri, self.client = mlflow, mlflow.get_tracking_uri(), None
        self.failures, self.refused, self.stuck = 0, None, None

    def unsent(self):
        return Journal(self.journal).read_from(self.offset)

    def send_unsent(self, stopping=lambda: False):
        """Send what waits: True if all is sent; False if stopping() or a line MLflow did not take ends it."""
        pending = self.unsent()
        while pending and not self.stuck:
            op, count = batch(pending)
            try:
                self.send(op)
            except Exception as exc:
                if transient(exc):
                    self.failures += 1
                    if self.failures == 1:
                        log.warning("MLflow: cannot reach %s (%s); the journal keeps everything and is "
                                    "retried", self.uri, common.first_line(exc))
                    if stopping():
                        return False
                    time.sleep(RETRY_DELAYS_S[min(self.failures, len(RETRY_DELAYS_S)) - 1])
                    continue
                if op["op"] == "start" and isinstance(exc, self.mlflow.MlflowException):
                    why = common.first_line(exc)
                    self.refused = f"MLflow at {self.uri} refused to start the run: {why}"
                    raise common.UsageError(self.refused) from None
                self.stuck = f"its {op['op']} line at byte {self.offset} ({common.first_line(exc)})"
                log.warning("MLflow: %s did not take %s; the run waits in %s: `python -m fmnist.tracking "
                            "sync %s` sends it", self.uri, self.stuck, self.journal, self.journal.parent)
                return False
            if self.failures:
                log.info("MLflow: %s answers again; sending what waited", self.uri)
                self.failures = 0
            self.offset, pending = pending[count - 1][0], pending[count:]
            state = {"offset": self.offset, "run_id": self.run_id}
            common.write_atomic(self.position, json.dumps(state).encode(), sync=False)
        return not pending

    def send(self, op):
        from mlflow.entities import Metric
        self.client = self.client or self.connect()
        if op["op"] == "metrics":
            self.client.log_batch(self.run_id, metrics=[Metric(*point) for point in op["points"]])
        elif op["op"] == "artifact":
            self.client.log_artifact(self.run_id, op["path"])
        elif op["op"] == "end":
            self.client.set_terminated(self.run_id, op["status"])
        else:
            getattr(self, op["op"])(op)  # the methods start and log_model below

    def connect(self):
        """The client. Making one makes a new local store, and two jobs making one store at once race in
        MLflow's migrations: on a local store, one at a time."""
        if not self.uri.startswith("sqlite:///"):
            return self.mlflow.MlflowClient(self.uri)
        store_lock = Path(self.uri.removeprefix("sqlite:///") + ".lock")
        with common.hold_lock(store_lock, "the MLflow store", wait=True):
            return self.mlflow.MlflowClient(self.uri)

    def start(self, op):
        """The run's start: the training's run continued if it resumed and the store has it, or a new one."""
        from mlflow.entities import Dataset, DatasetInput, InputTag, Param
        tags = op["tags"]
        if op["continues"] and self.run_id:
            try:
                self.client.update_run(self.run_id, status="RUNNING")
                self.client.set_tag(self.run_id, "resumed", "true")
                return
            except self.mlflow.exceptions.MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                log.warning("MLflow: the training's run %s is not at %s (another tracking store); continuing "
                            "in a new run there, tagged resumed_from_run", self.run_id, self.uri)
                tags = {**tags, "resumed_from_run": self.run_id}
        experiment_id = self.experiment_id(op["experiment"])
        run = self.client.create_run(experiment_id, tags=tags, run_name=op["run_name"] or None)
        self.run_id = run.info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in op["params"].items()])
        self.client.log_inputs(self.run_id, [
            DatasetInput(Dataset(**fields), [InputTag("mlflow.data.context", context)])
            for context, fields in op["datasets"]])
        page = (f"{self.uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{self.run_id}?workflowType="
                "machine_learning" if self.uri.startswith(("http://", "https://")) else self.uri)
        log.info("MLflow: run %s in experiment '%s' at %s", self.run_id, op["experiment"], page)

    def experiment_id(self, name):
        """The experiment's id, made if it is new: another job making it at the same moment is no error."""
        if experiment := self.client.get_experiment_by_name(name):
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, tags=EXPERIMENT_TAGS)
        except self.mlflow.exceptions.MlflowException:
            if experiment := self.client.get_experiment_by_name(name):
                return experiment.experiment_id
            raise

    def log_model(self, op):
        """The MindIR as the run's pyfunc model, registered when asked. Its input is float64: MLflow casts a
        request to the declared type, and uint8 would wrap 300 to 44 unseen."""
        import pandas as pd
        example = np.asarray(op["example"], dtype=np.float64)
        # MLflow warns that integer columns cannot hold NaN: these never do.
        with warnings.catch_warnings(action="ignore", category=UserWarning):
            signature = self.mlflow.models.infer_signature(example, pd.DataFrame(op["predictions"]))
        with self.mlflow.start_run(run_id=self.run_id, log_system_metrics=False):
            version = self.mlflow.pyfunc.log_model(
                name="model", loader_module=SERVING_MODULE, data_path=op["mindir"],
                code_paths=[str(PACKAGE_DIR)], signature=signature, input_example=example,
                registered_model_name=op["register_as"] or None, await_registration_for=60,
                pip_requirements=str(PACKAGE_DIR.parent / "requirements.txt")).registered_model_version
        if op["register_as"]:
            accuracy = f"{op['test_accuracy']:.4f}"
            self.client.set_model_version_tag(op["register_as"], version, "test_accuracy", accuracy)
            log.info("MLflow: registered model %s version %s", op["register_as"], version)


class NullTracker:
    """Tracking on ranks other than 0, or with --tracking off: every call takes anything, records nothing."""

    run_id = None

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class Tracker:
    """Rank 0's tracking: it appends to the journal; online, a sender thread follows it."""

    def __init__(self, cfg, node):
        self.cfg, self.output_dir, self.online, self.node = cfg, cfg.output_dir, cfg.tracking == "on", node
        self.journal, self.sender, self.thread = Journal(cfg.output_dir / JOURNAL), None, None
        self.finishing, self.system_stopped = threading.Event(), threading.Event()
        self.starting, self.start_error, self.started_at = None, None, 0
        # Metric points logged before the start line is journaled wait here, to follow it in the journal.
        self.journaling, self.early_points = threading.Lock(), []
        # On a resume, each metric's newest step in the journal: no point at or before it is journaled again.
        self.journaled = {}

    @property
    def run_id(self):
        return self.sender and self.sender.run_id

    def start(self, params, tags, datasets, continues):
        """The run's start, on a thread of its own: MLflow's import and the run's creation take seconds that
        training need not wait for. started() awaits it."""
        self.starting = threading.Thread(target=self._journal_start, args=(params, tags, datasets, continues),
                                         daemon=True)
        self.starting.start()

    def _journal_start(self, params, tags, datasets, continues):
        """Journal the run's start with MLflow's context tags (user, source, commit); online, send it."""
        try:
            import mlflow
            params = {key: str(value) for key, value in params.items()}
            entities, tags = datasets(), mlflow.tracking.context.registry.resolve_tags(tags)
            # Made outside the lock, which the training thread takes to log: nothing appends before the start.
            self.journaled = self.journal.last_steps() if continues else {}
            with self.journaling:
                self.journal.append("start", experiment=self.cfg.experiment, run_name=self.cfg.run_name,
                                    params=params, datasets=entities, continues=continues, tags=tags)
                for point in self.early_points:
                    self._append_point(point)
                self.early_points = None
            if self.online:
                self.started_at, self.sender = self.journal.path.stat().st_size, Sender(self.output_dir)
                self.thread = threading.Thread(target=self._follow, daemon=True)
                self.thread.start()
            threading.Thread(target=self._sample_system, daemon=True).start()
        except Exception as exc:
            self.start_error = exc

    def started(self):
        """Once MLflow took the run's start, or START_WAIT_S went by trying. UsageError if it refused it (the
        journal's lines taken back); the start's own error, such as DiskFull, raised here."""
        self.starting.join()
        if self.start_error:
            raise self.start_error
        def waiting():
            return (self.online and self.sender.offset < self.started_at and not self.sender.failures
                    and self.thread.is_alive())
        deadline = time.monotonic() + START_WAIT_S
        while waiting() and time.monotonic() < deadline:
            time.sleep(0.05)
        if waiting():
            log.warning("MLflow: %s has not taken the run's start within %d s; training goes on, the journal "
                        "keeps everything for it", self.sender.uri, START_WAIT_S)
        if self.online and self.sender.refused:
            self.system_stopped.set()
            self.journal.rollback()
            raise common.UsageError(self.sender.refused)

    def log_metrics(self, values, step):
        values = {key: float(value) for key, value in values.items()}
        point = {"step": int(step), "timestamp": int(time.time() * 1000), "values": values}
        with self.journaling:
            if self.early_points is not None:
                self.early_points.append(point)
                return
        self._append_point(point)

    def _append_point(self, point):
        # A job resumed after a kill -9 trains again the steps since its checkpoint, whose points the stopped
        # job journaled: the run keeps one point a step.
        values = {key: value for key, value in point["values"].items()
                  if point["step"] > self.journaled.get(key, -1)}
        if values:
            self.journal.append("metrics", **{**point, "values": values})

    def log_artifact(self, path):
        self.journal.append("artifact", path=str(Path(path).resolve()))

    def log_model(self, mindir, example, predictions, register_as, test_accuracy):
        self.journal.append("log_model", mindir=str(Path(mindir).resolve()), example=example.tolist(),
                            predictions=predictions.to_dict(orient="list"), register_as=register_as,
                            test_accuracy=float(test_accuracy))

    def finish(self, status, timeout=None):
        """The run's end journaled; online, the sender has `timeout` s (else --tracking-wait) for the rest."""
        self.system_stopped.set()
        self.starting.join()
        if self.start_error or self.sender and self.sender.refused:
            return
        self.journal.append("end", status=status)
        if not self.online:
            log.info("MLflow: offline; `python -m fmnist.tracking sync %s` sends the run", self.output_dir)
            return
        self.finishing.set()
        self.thread.join(timeout := timeout or self.cfg.tracking_wait)
        if (left := len(self.sender.unsent())) and not self.sender.stuck:
            log.warning("MLflow: %s did not take the last %d operations within %.0f s; they wait in %s: the "
                        "next start sends them, or `python -m fmnist.tracking sync %s`", self.sender.uri,
                        left, timeout, self.journal.path, self.output_dir)

    def _follow(self):
        while not self.sender.stuck:
            finishing = self.finishing.is_set()  # before the journal is read: then the end is in it
            try:
                if self.sender.send_unsent(stopping=self.finishing.is_set) and finishing:
                    return
            except common.UsageError:
                return  # the start was refused, which Tracker.start says
            except Exception as exc:
                log.warning("MLflow: the sender failed (%s); the journal keeps it", common.first_line(exc))
            with self.journal.appended:
                self.journal.appended.wait(1)

    def _sample_system(self):
        """Node 0's CPU, memory, disk and network by MLflow's own monitors, into the journal until the end."""
        from mlflow.system_metrics.metrics import cpu_monitor, disk_monitor, network_monitor
        monitors = [cpu_monitor.CPUMonitor(), disk_monitor.DiskMonitor(), network_monitor.NetworkMonitor()]
        interval_s = float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL") or 10)
        # A resumed job's samples follow the stopped job's.
        step = 1 + max((last for key, last in self.journaled.items() if key.startswith("system/")),
                       default=-1)
        while not self.system_stopped.wait(interval_s):
            try:
                values = {}
                for monitor in monitors:
                    monitor.collect_metrics()
                    values.update(monitor.aggregate_metrics())
                    monitor.clear_metrics()
                values = {f"system/{self.node}/{key}": value for key, value in values.items()}
                self.log_metrics(values, step)
                step += 1
            except Exception as exc:
                log.warning("MLflow: system metrics not logged: %s", common.first_line(exc))


def start(job, continues, splits, sources):
    """A main.Job's tracker: rank 0's journals the run's start and, online, creates or continues the run, as
    training begins (Tracker.started); elsewhere, or with --tracking off, a NullTracker."""
    cfg, collective = job.cfg, job.collective
    if cfg.tracking == "off" or not collective.is_main:
        return NullTracker()
    tracker = Tracker(cfg, f"node{os.environ.get('NODE_RANK', '0')}")  # run.sh exports NODE_RANK
    params = {**dataclasses.asdict(cfg), **job.resolved, "onednn_isa_cap": job.cpu["onednn_isa_cap"],
              "cpu_model": job.cpu["model"], "global_batch_size": cfg.batch_size * collective.world_size,
              "mindspore_version": importlib.metadata.version("mindspore"), "job_version": common.JOB_VERSION}
    tags = {"device": job.device, "world_size": str(collective.world_size), "job_version": common.JOB_VERSION}
    # An image has no .git for MLflow's git context to read: its build says which commit it is.
    if os.environ.get("GIT_COMMIT"):
        tags["mlflow.source.git.commit"] = os.environ["GIT_COMMIT"]
    datasets = functools.partial(dataset_entities, splits, job.checksums, sources)
    tracker.start(params, tags, datasets, continues)
    return tracker


def dataset_entities(splits, checksums, sources):
    """The splits as MLflow dataset entities, [(context, fields)], their digests from the data's checksums."""
    import mlflow
    entities = []
    for context, split, part in (("training", "train", splits.train), ("evaluation", "test", splits.test)):
        names = data.FILES[split]
        digest = hashlib.sha256("".join(checksums[name] for name in names).encode()).hexdigest()[:32]
        # MLflow warns that a path source reads two ways, then takes the local one, which it is.
        with warnings.catch_warnings(action="ignore", category=UserWarning):
            dataset = mlflow.data.from_numpy(part.images, targets=part.labels, digest=digest,
                                             source=sources.get(names[0], ""), name=f"{data.NAME}-{split}")
        entities.append((context, dataset._to_mlflow_entity().to_dictionary()))
    return entities


def main(argv=None):
    """`sync OUTPUT_DIR`: exit 0 all sent; 1 the server stayed away or did not take a line; 2 bad input."""
    parser = argparse.ArgumentParser(prog="python -m fmnist.tracking",
                                     description="Send a job's MLflow journal.")
    commands = parser.add_subparsers(dest="command", required=True)
    sync = commands.add_parser("sync", help="send OUTPUT_DIR's journal")
    sync.add_argument("output_dir", type=Path, help="the job's --output-dir")
    sync.add_argument("--timeout", type=float, default=60, help="seconds to retry an unreachable server")
    args = parser.parse_args(argv)
    common.configure_logging(0)
    try:
        if not (args.output_dir / JOURNAL).exists():
            raise common.UsageError(f"{args.output_dir} holds no MLflow journal ({JOURNAL})")
        with common.hold_lock(args.output_dir / ".lock", str(args.output_dir)):
            sender, deadline = Sender(args.output_dir), time.monotonic() + args.timeout
            sent = sender.send_unsent(stopping=lambda: time.monotonic() > deadline)
    except common.UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    if sent:
        print(f"MLflow: the journal of {args.output_dir} is sent: run {sender.run_id} at {sender.uri}")
        return 0
    why = (f"{sender.uri} did not take {sender.stuck}" if sender.stuck else
           f"MLflow at {sender.uri} did not answer within {args.timeout:g} s")
    print(f"error: {why}; {len(sender.unsent())} operations still wait in {sender.journal}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
