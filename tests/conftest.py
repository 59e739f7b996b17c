"""Shared fixtures: tiny generated Fashion-MNIST-shaped IDX data and a runner for the real job."""

import contextlib
import gzip
import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Shared with the test modules, which import them from here.
from servers import free_port, mlflow_server, models_serve, reserved_port, wait_until_up  # noqa: E402,F401

# The operators' CRDs, beside the checkout (not in a clone elsewhere): without them 9 checks are skipped.
CRDS = ROOT / "tests" / "crds"  # the operators' CRDs, copied unchanged: SOURCES.md
SPLITS = {"train": 256, "t10k": 96}  # samples: enough for a few steps per worker, seconds per epoch


def idx_bytes(array):
    """The IDX encoding of a uint8 array: magic (0x08 = unsigned byte, then ndim), big-endian dims, data."""
    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.tobytes()


def make_split(count, seed):
    """Images whose class shows as a bright horizontal band, so a model can learn them quickly."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % 10
    images = rng.integers(0, 60, size=(count, 28, 28))
    for image, label in zip(images, labels):
        image[2 + 2 * label: 4 + 2 * label] = 230
    return images.astype(np.uint8), labels.astype(np.uint8)


def write_dataset(directory, seed=0, splits=None):
    """Write the four gzipped IDX files and a sha256sum-style CHECKSUMS file; return {name: raw IDX bytes}."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = {}
    for offset, (split, count) in enumerate((splits or SPLITS).items()):
        images, labels = make_split(count, seed + offset)
        raw[f"{split}-images-idx3-ubyte"] = idx_bytes(images)
        raw[f"{split}-labels-idx1-ubyte"] = idx_bytes(labels)
    for name, content in raw.items():
        (directory / f"{name}.gz").write_bytes(gzip.compress(content, mtime=0))
    checksum_lines = [f"{hashlib.sha256(c).hexdigest()}  {n}" for n, c in raw.items()]
    (directory / "CHECKSUMS").write_text("\n".join(checksum_lines) + "\n")
    return raw


# The modules whose tests take longest go first and the quick ones last, so that the quick ones fill the
# pytest-xdist workers' ends instead of one worker finishing a long test alone (docs/testing.md).
LONGEST_FIRST = ("test_world_size", "test_reliability", "test_own_network", "test_preemption",
                 "test_tracking", "test_fault_tolerance", "test_job", "test_failures", "test_bad_input",
                 "test_deploy", "test_data_fetch")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks
def pytest_collection_modifyitems(items):
    """The tests reading one module-scoped job go to one pytest-xdist worker (`--dist loadgroup`, as make
    test runs them): spread over two, each would run that job. Modules run in LONGEST_FIRST's order, others
    after."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))
    for item in items:
        fixtures = item._fixtureinfo.name2fixturedefs.values()  # pylint: disable=protected-access
        if any(definitions[-1].scope == "module" for definitions in fixtures):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A read-only-by-convention tiny dataset shared by the tests; copy it before changing it."""
    directory = tmp_path_factory.mktemp("tiny-data")
    write_dataset(directory)
    return directory


@pytest.fixture(scope="session")
def longer_data(tmp_path_factory):
    """Epochs of a few seconds, 256 steps with 2 workers of batch 16: a job is still training when a test acts
    on it, and past the 200 steps after which learning is judged."""
    directory = tmp_path_factory.mktemp("longer-data")
    write_dataset(directory, splits={"train": 8192, "t10k": 256})
    return directory


def job_env(**overrides):
    """The environment the job runs in: this venv's python first on PATH (msrun launches `python` from
    PATH), no tracking server unless a test sets one, and a quiet MindSpore."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"MPLBACKEND": "Agg", "GLOG_v": "3", "PYTHONUNBUFFERED": "1"})
    env.update(overrides)
    return env


def tiny_args(data_dir, output_dir, *extra):
    return ["--data-dir", str(data_dir), "--checksums-file", str(data_dir / "CHECKSUMS"),
            "--output-dir", str(output_dir), "--epochs", "1", "--batch-size", "16",
            "--log-interval", "2", "--data-mirrors", "", *extra]


def run_msrun(cwd, args, workers=2, timeout=300, env=None):
    """The real launcher, as the README runs it: msrun with `workers` CPU workers on this machine."""
    log_dir = Path(cwd) / "msrun-logs"
    cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", "--join=True",
           f"--master_port={free_port()}", f"--log_dir={log_dir}", "python", str(ROOT / "main.py"), *args]
    result = subprocess.run(cmd, cwd=cwd, env=env or job_env(), capture_output=True, text=True,
                            timeout=timeout, check=False)
    result.logs = {p.name: p.read_text(errors="replace") for p in log_dir.glob("*.log")}
    return result


def run_main(cwd, args, env=None, timeout=300):
    """The job as one process, without msrun."""
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], cwd=cwd, env=env or job_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def run_sh(cwd, args, timeout=300, **env):
    """The launcher, as the image and Kubernetes start it; `console` is its stdout and stderr together."""
    result = subprocess.run([str(ROOT / "run.sh"), *args], cwd=cwd, env=job_env(**env), capture_output=True,
                            text=True, timeout=timeout, check=False)
    result.console = result.stdout + result.stderr
    return result


@contextlib.contextmanager
def small_volume(path, size):
    """A tmpfs of `size` at `path`, unmounted afterwards."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def no_traceback(result, log_dir):
    """Whether no traceback shows in run.sh's report or in any worker's log of `log_dir` (msrun's own
    traceback goes to msrun.log, and its scheduler's to scheduler.log, when a worker fails)."""
    texts = {"run.sh": result.stderr,
             **{p.name: p.read_text(errors="replace") for p in Path(log_dir).glob("worker_*.log")}}
    return not [name for name, text in texts.items() if "Traceback" in text]


def wait_for(path, pattern, process, timeout=240):
    """The first match of `pattern` in the file at `path`, polling while `process` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists():
            match = re.search(pattern, path.read_text(errors="replace"))
            if match:
                return match
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} did not appear in {path}")


def worker_pids(log_dir, workers=2):
    """The pid each worker logged at start ("rank N of M (pid P)"), by rank."""
    return [int(re.search(rf"rank {rank} of \d+ \(pid (\d+)\)",
                          (Path(log_dir) / f"worker_{rank}.log").read_text())
                .group(1)) for rank in range(workers)]


def job_processes(pid):
    """Every process below `pid`: msrun, its scheduler and its workers, which run in sessions of their own, so
    that no process-group signal reaches them all."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def runs_main_py(process):
    """Whether `process` runs the job's main.py; False for one that ended meanwhile (run.sh's sleeps and greps
    come and go while it watches the job)."""
    try:
        return str(ROOT / "main.py") in process.cmdline()
    except psutil.NoSuchProcess:
        return False


def kill_all(processes):
    """SIGKILL each process and wait until it is gone."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=30)


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_summary(output_dir):
    return json.loads((Path(output_dir) / "summary.json").read_text())


class Mirror(http.server.ThreadingHTTPServer):
    """Serves the tiny dataset's .gz files under /<behaviour>/<file>; counts every request by path."""

    daemon_threads = True  # a hanging handler must not hold up shutdown

    def __init__(self, files):
        super().__init__(("127.0.0.1", 0), MirrorHandler)
        self.files, self.requests = files, Counter()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def total(self, behaviour):
        return sum(n for path, n in self.requests.items() if path.startswith(f"/{behaviour}/"))


class MirrorHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.server.requests[self.path] += 1
        behaviour, _, name = self.path.strip("/").partition("/")
        body = self.server.files.get(name)
        if body is None or behaviour == "missing":
            self.send_error(404)
            return
        if behaviour == "hang":
            time.sleep(5)
            return
        if behaviour == "slow":  # a whole second per file: long enough for another job to start meanwhile
            time.sleep(1)
        if behaviour in ("trickle", "steady"):
            self.pace(body, *((1, 0.2) if behaviour == "trickle" else (16 << 10, 0.05)))
            return
        if behaviour == "corrupt":
            body = gzip.compress(gzip.decompress(body)[:-1] + b"\x01", mtime=0)
        elif behaviour == "truncated":
            body = body[: len(body) // 2]
        elif behaviour == "html":
            body = b"<html><body><h1>Service unavailable</h1></body></html>"
        self.send_response(200)
        self.send_header("Content-Length",
                         str(len(self.server.files[name]) if behaviour == "cut" else len(body)))
        self.end_headers()
        # "cut" promises the whole file and closes the connection half-way, like a dropped link.
        self.wfile.write(body[: len(body) // 2] if behaviour == "cut" else body)

    def pace(self, body, chunk, interval):
        """Send `body` `chunk` bytes every `interval` seconds: "trickle" like a stuck proxy, with no
        Content-Length, and "steady", fast enough for any minimum rate but slow for a big file."""
        self.send_response(200)
        if chunk > 1:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for start in range(0, len(body), chunk):
                self.wfile.write(body[start:start + chunk])
                self.wfile.flush()
                time.sleep(interval)
        except OSError:  # the client gave up, as it should
            pass


@contextlib.contextmanager
def serve(files):
    """A Mirror on a free loopback port, serving {file name: bytes}, for the duration of the block."""
    server = Mirror(files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def rendered(manifest):
    """The manifest's documents, as `kubectl apply` would send them (an overlay through kubectl's
    kustomize)."""
    if manifest.endswith(".yaml"):
        return list(yaml.safe_load_all((ROOT / manifest).read_text()))
    result = subprocess.run(["kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone", manifest],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    return list(yaml.safe_load_all(result.stdout))
