"""Every MLflow call of the job, as one journal: rank 0 appends each tracking operation, in order, to
<output-dir>/mlflow-journal.jsonl, and one sender carries it to MLflow from the position it recorded last.

Online the sender follows the journal on a thread of rank 0; `python -m fmnist.tracking sync OUTPUT_DIR` is the
same sender, later (after --tracking offline, or what a job could not send). A line sent twice, after a
kill -9 between a send and its recorded position, is harmless: MLflow's store keeps one copy of a metric point
with the same key, step, time and value. Transient failures (unreachable, time-out, 5xx, 429) are retried; a
refused start (401, 403, a URI MLflow cannot use) is Refused, the job's exit 2; any other failure is one line.
"""

import argparse
import json
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path

from . import common, serving
from .common import log

JOURNAL, POSITION = "mlflow-journal.jsonl", "mlflow-journal.position"  # in the output directory
# MLflow retries a dead server for minutes by default; the sender retries on its own. Its telemetry would be
# one more thread reaching for the internet from every training pod.
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}  # the UI's "Model training" view
RETRY_DELAYS_S = (1, 2, 4, 8, 15, 30)
START_WAIT_S = 15  # what training waits for the run's creation to be tried
STOP_TIMEOUT_S = 10  # what a stopped job waits for MLflow: the pod's 30 s grace period must hold it all
SERVING_EXAMPLE_IMAGES = 4
PACKAGE_DIR = Path(__file__).resolve().parent


class Refused(Exception):
    """The tracking server refused to start the run: credentials, permissions or the URI."""


def kind_of_failure(exc):
    """"transient" (worth retrying), "refused" (the server said no) or "error" (anything else)."""
    from mlflow.exceptions import MlflowException  # pylint: disable=import-outside-toplevel
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return "transient" if status >= 500 or status == 429 else "refused"
    if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__module__.startswith(("requests", "urllib3")):
        return "transient"
    return "error"


def first_line(exc):
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


class Journal:
    """The append-only journal of one output directory: one JSON line per operation, written whole."""

    def __init__(self, output_dir):
        self.path = Path(output_dir) / JOURNAL
        self.appended = threading.Condition()
        self.rollback_to = None  # its size before this process's first line

    def append(self, op, **fields):
        line = json.dumps({"op": op, **fields}) + "\n"  # refuses what it cannot write: nothing half-safe
        with self.appended, common.space_for(self.path):
            if self.rollback_to is None:
                self.rollback_to = self.path.stat().st_size if self.path.exists() else 0
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(line)
            self.appended.notify_all()

    def rollback(self):
        """Remove what this process appended: its start was refused, so none of it belongs to a run."""
        if self.rollback_to is not None:
            os.truncate(self.path, self.rollback_to)


class Sender:
    """Sends a journal's lines from the recorded position, recording the position (and the run) after each."""

    def __init__(self, output_dir):
        import mlflow  # pylint: disable=import-outside-toplevel
        for name, value in MLFLOW_DEFAULTS.items():
            os.environ.setdefault(name, value)  # a user's setting wins
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # the sender's own line says it
        self.journal, self.position = Path(output_dir) / JOURNAL, Path(output_dir) / POSITION
        state = json.loads(self.position.read_text()) if self.position.exists() else {}
        self.offset, self.run_id = state.get("offset", 0), state.get("run_id")
        self.mlflow, self.uri, self.client = mlflow, mlflow.get_tracking_uri(), None
        self.failures, self.refused = 0, None

    def unsent(self):
        """[(offset after the line, operation)] of the whole lines not sent yet."""
        lines, offset = [], self.offset
        if self.journal.exists():
            with open(self.journal, "rb") as journal:
                journal.seek(offset)
                for line in journal:
                    if not line.endswith(b"\n"):
                        break  # being written
                    offset += len(line)
                    lines.append((offset, json.loads(line)))
        return lines

    def send_unsent(self, stopping=lambda: False):
        """Send what waits, in order; True when nothing is left. Retries transient failures until stopping()."""
        pending = self.unsent()
        while pending:
            batch = pending[:1]  # consecutive metric points go in one request, up to MLflow's 1000 values
            while (batch[-1][1]["op"] == "metrics" and len(batch) < len(pending)
                   and pending[len(batch)][1]["op"] == "metrics"
                   and sum(len(line["values"]) for _, line in batch) < 900):
                batch.append(pending[len(batch)])
            op = batch[0][1]["op"]
            try:
                self.send([line for _, line in batch])
            except Exception as exc:  # pylint: disable=broad-except
                kind = kind_of_failure(exc)
                if kind == "transient":
                    self.failures += 1
                    if self.failures == 1:
                        log.warning("MLflow: cannot reach %s (%s); the journal keeps everything and is retried",
                                    self.uri, first_line(exc))
                    if stopping():
                        return False
                    time.sleep(RETRY_DELAYS_S[min(self.failures, len(RETRY_DELAYS_S)) - 1])
                    continue
                if kind == "refused" and op == "start":
                    self.refused = f"MLflow at {self.uri} refused to start the run: {first_line(exc)}"
                    raise Refused(self.refused) from None
                log.warning("MLflow: %d %s not logged, skipped: %s", len(batch), op, first_line(exc))
            if self.failures:
                log.info("MLflow: %s answers again; sending what waited", self.uri)
                self.failures = 0
            self.offset, pending = batch[-1][0], pending[len(batch):]
            state = json.dumps({"offset": self.offset, "run_id": self.run_id}).encode()
            common.write_atomic(self.position, state, sync=False)
        return True

    def send(self, ops):
        from mlflow.entities import Metric  # pylint: disable=import-outside-toplevel
        self.client = self.client or self.mlflow.MlflowClient(self.uri)
        op = ops[0]
        if op["op"] == "start":
            self.start(op)
        elif op["op"] == "metrics":
            self.client.log_batch(self.run_id, metrics=[Metric(key, value, line["timestamp"], line["step"])
                                                        for line in ops for key, value in line["values"].items()])
        elif op["op"] == "artifact":
            self.client.log_artifact(self.run_id, op["path"])
        elif op["op"] == "model":
            self.log_model(op)
        elif op["op"] == "end":
            self.client.set_terminated(self.run_id, op["status"])

    def start(self, op):
        """Continue the training's run when it resumed and the store has it; else create one."""
        from mlflow.entities import Dataset, DatasetInput, InputTag, Param  # pylint: disable=import-outside-toplevel
        tags = op["tags"]
        if op["continues"] and self.run_id:
            try:
                self.client.update_run(self.run_id, status="RUNNING")
                self.client.set_tag(self.run_id, "resumed", "true")
                return
            except self.mlflow.exceptions.MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                log.warning("MLflow: the training's run %s is not at %s (another tracking store); continuing in a "
                            "new run there, tagged resumed_from_run", self.run_id, self.uri)
                tags = {**tags, "resumed_from_run": self.run_id}
        experiment = self.client.get_experiment_by_name(op["experiment"])
        experiment_id = (experiment.experiment_id if experiment
                         else self.client.create_experiment(op["experiment"], tags=EXPERIMENT_TAGS))
        for key, value in EXPERIMENT_TAGS.items():
            if experiment and key not in experiment.tags:  # a kind the user chose stays
                self.client.set_experiment_tag(experiment_id, key, value)
        self.run_id = self.client.create_run(experiment_id, tags=tags, run_name=op["run_name"] or None).info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in op["params"].items()])
        self.client.log_inputs(self.run_id, [DatasetInput(Dataset(**fields), [InputTag("mlflow.data.context", c)])
                                             for c, fields in op["datasets"]])
        page = self.uri if not self.uri.startswith(("http://", "https://")) else (  # the UI's model-training view
            f"{self.uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{self.run_id}?workflowType=machine_learning")
        log.info("MLflow: run %s in experiment '%s' at %s", self.run_id, op["experiment"], page)

    def log_model(self, op):
        """The MindIR as the run's pyfunc model `model` (loaded by fmnist.serving), with its signature, real test
        images as its input example and the job's pins; registered when asked, tagged with the test accuracy."""
        import pandas as pd  # pylint: disable=import-outside-toplevel
        signature, example = serving.served_signature(op["example"], pd.DataFrame(op["predictions"]))
        with self.mlflow.start_run(run_id=self.run_id, log_system_metrics=False):
            info = self.mlflow.pyfunc.log_model(
                name="model", loader_module=serving.__name__, data_path=op["mindir"], code_paths=[str(PACKAGE_DIR)],
                signature=signature, input_example=example, registered_model_name=op["register_as"] or None,
                pip_requirements=str(PACKAGE_DIR.parent / "requirements.txt"), await_registration_for=60)
        if op["register_as"]:
            self.client.set_model_version_tag(op["register_as"], info.registered_model_version, "test_accuracy",
                                              f"{op['test_accuracy']:.4f}")
            log.info("MLflow: registered model %s version %s", op["register_as"], info.registered_model_version)


class NullTracker:
    """Tracking on ranks other than 0, or with --tracking off: takes everything, records nothing."""

    run_id = None

    def log_metrics(self, values, step):
        pass

    def log_artifact(self, path):
        pass

    def log_model(self, mindir, example, predictions, register_as, test_accuracy):
        pass

    def finish(self, status, timeout=None):
        pass


class Tracker(NullTracker):
    """Rank 0's tracking: it appends to the journal; online, a sender thread follows it."""

    def __init__(self, output_dir, online, node, wait_s):
        self.output_dir, self.online, self.wait_s = Path(output_dir), online, wait_s
        self.journal, self.sender, self.thread = Journal(output_dir), None, None
        self.finishing, self.system = threading.Event(), SystemMetrics(self.log_metrics, node)

    @property
    def run_id(self):
        return self.sender and self.sender.run_id

    def start(self, experiment, run_name, params, tags, datasets, continues):
        """Journal the run's start; online, wait START_WAIT_S at most for it to be tried. Refused: exit 2."""
        self.journal.append("start", experiment=experiment, run_name=run_name, params=params, tags=tags,
                            datasets=datasets, continues=continues)
        if self.online:
            started_at, deadline = self.journal.path.stat().st_size, time.monotonic() + START_WAIT_S
            self.sender = Sender(self.output_dir)
            self.thread = threading.Thread(target=self._follow, name="mlflow-sender", daemon=True)
            self.thread.start()
            while (self.sender.offset < started_at and not self.sender.failures and self.thread.is_alive()
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            if self.sender.refused:
                self.journal.rollback()
                raise Refused(self.sender.refused)
        self.system.start()

    def log_metrics(self, values, step):
        self.journal.append("metrics", step=int(step), timestamp=int(time.time() * 1000),
                            values={key: float(value) for key, value in values.items()})

    def log_artifact(self, path):
        self.journal.append("artifact", path=str(Path(path).resolve()))

    def log_model(self, mindir, example, predictions, register_as, test_accuracy):
        self.journal.append("model", mindir=str(Path(mindir).resolve()), example=example.tolist(),
                            predictions=predictions.to_dict(orient="list"), register_as=register_as,
                            test_accuracy=float(test_accuracy))

    def finish(self, status, timeout=None):
        """Journal the run's end; online, give the sender `timeout` seconds to send what is left."""
        self.system.stop()
        self.journal.append("end", status=status)
        if not self.online:
            log.info("MLflow: offline; `python -m fmnist.tracking sync %s` sends the run", self.output_dir)
            return
        self.finishing.set()
        with self.journal.appended:
            self.journal.appended.notify_all()
        self.thread.join(timeout or self.wait_s)
        if self.sender.unsent():
            log.warning("MLflow: %s did not take the last %d operations within %.0f s; they wait in %s: the next "
                        "start sends them, or `python -m fmnist.tracking sync %s`", self.sender.uri,
                        len(self.sender.unsent()), timeout or self.wait_s, self.journal.path, self.output_dir)

    def _follow(self):
        while True:
            finishing = self.finishing.is_set()  # before reading: once it is set, the end is in the journal
            try:
                if self.sender.send_unsent(stopping=self.finishing.is_set) and finishing:
                    return
            except Refused:
                return
            except Exception as exc:  # pylint: disable=broad-except
                log.warning("MLflow: the sender failed (%s); the journal keeps what it did not send", first_line(exc))
            with self.journal.appended:
                self.journal.appended.wait(1)


class SystemMetrics:
    """A node's CPU, memory, disk and network from MLflow's own monitors, every
    MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL s (10), handed to `log(values, step)`."""

    def __init__(self, log_metrics, node):
        self.log_metrics, self.prefix = log_metrics, f"system/{node}/"
        self.stopped, self.thread = threading.Event(), None

    def start(self):
        self.thread = threading.Thread(target=self._sample, name="system-metrics", daemon=True)
        self.thread.start()

    def stop(self):
        self.stopped.set()
        if self.thread:
            self.thread.join(5)

    def _sample(self):
        from mlflow.system_metrics.metrics import (  # pylint: disable=import-outside-toplevel
            cpu_monitor, disk_monitor, network_monitor)
        monitors = [cpu_monitor.CPUMonitor(), disk_monitor.DiskMonitor(), network_monitor.NetworkMonitor()]
        step = 0
        while not self.stopped.wait(float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL") or 10)):
            try:
                values = {}
                for monitor in monitors:
                    monitor.collect_metrics()
                    values.update({self.prefix + k: v for k, v in monitor.aggregate_metrics().items()})
                    monitor.clear_metrics()
                self.log_metrics(values, step)
                step += 1
            except Exception as exc:  # pylint: disable=broad-except
                log.warning("MLflow: system metrics not logged: %s", first_line(exc))


def direct_logger(run_id):
    """log(values, step) straight to the run: a further node's system metrics, online only."""
    import mlflow  # pylint: disable=import-outside-toplevel
    from mlflow.entities import Metric  # pylint: disable=import-outside-toplevel
    client = mlflow.MlflowClient()
    return lambda values, step: client.log_batch(run_id, metrics=[
        Metric(k, v, int(time.time() * 1000), step) for k, v in values.items()])


def mlflow_tags(tags):
    """The run's tags with MLflow's context tags (user, source, git commit) resolved here, where the job runs."""
    import mlflow  # pylint: disable=import-outside-toplevel
    return mlflow.tracking.context.registry.resolve_tags(tags)


def dataset_entities(splits, checksums, sources):
    """The splits as MLflow dataset entities, [(context, fields)]; the digest comes from the pinned SHA-256 of
    the content, so equal digests mean equal data."""
    import hashlib  # pylint: disable=import-outside-toplevel
    import mlflow  # pylint: disable=import-outside-toplevel
    entities = []
    for context, split, part in (("training", "train", splits.train), ("evaluation", "t10k", splits.test)):
        names = [f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"]
        digest = hashlib.sha256("".join(checksums[n] for n in names).encode()).hexdigest()[:32]
        with warnings.catch_warnings():  # that a local path could be one of two kinds of local source
            warnings.simplefilter("ignore", UserWarning)
            entity = mlflow.data.from_numpy(part.images, targets=part.labels, source=sources.get(names[0], ""),
                                            name=f"fashion-mnist-{split}", digest=digest)._to_mlflow_entity()
        entities.append((context, {field: getattr(entity, field)
                                   for field in ("name", "digest", "source_type", "source", "schema", "profile")}))
    return entities


def main(argv=None):
    """`sync OUTPUT_DIR`: send the journal. Exit 0 all sent, 1 the server stayed away, 2 refused or bad input."""
    parser = argparse.ArgumentParser(prog="python -m fmnist.tracking", description="Send a job's MLflow journal.")
    sync = parser.add_subparsers(dest="command", required=True).add_parser(
        "sync", help="send what OUTPUT_DIR's journal holds to MLFLOW_TRACKING_URI")
    sync.add_argument("output_dir", type=Path, help="the job's --output-dir")
    sync.add_argument("--timeout", type=float, default=60, help="seconds to retry an unreachable server")
    args = parser.parse_args(argv)
    common.configure_logging(0)
    try:
        if not (args.output_dir / JOURNAL).exists():
            raise common.UsageError(f"{args.output_dir} holds no MLflow journal ({JOURNAL})")
        with common.locked(args.output_dir / ".lock", str(args.output_dir)):  # a running job sends its own
            sender, deadline = Sender(args.output_dir), time.monotonic() + args.timeout
            if not sender.send_unsent(stopping=lambda: time.monotonic() > deadline):
                print(f"error: MLflow at {sender.uri} did not answer within {args.timeout:g} s; "
                      f"{len(sender.unsent())} operations still wait in {sender.journal}", file=sys.stderr)
                return 1
    except (common.UsageError, Refused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    print(f"MLflow: the journal of {args.output_dir} is sent: run {sender.run_id} at {sender.uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
