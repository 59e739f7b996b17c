"""Real servers on loopback for the tests and the benchmark: a free port, a readiness poll, an `mlflow server`
with its own SQLite store, and `mlflow models serve` of a logged model. Standard library only, so that the
benchmark can use it without pytest."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PROBE = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reserved_port():
    """A free port for a server that goes away and comes back on it: below Linux's ephemeral range, where
    free_port() and every client draw, and in a block of its own for each pytest-xdist worker, so no parallel
    test takes it while no server listens."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    for port in range(20000 + 200 * worker + os.getpid() % 100, 20000 + 200 * (worker + 1)):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port reserved for pytest-xdist worker {worker}")


def wait_until_up(url, process, log_path, timeout=120, prefix=()):
    """Poll `url` until it answers 200, from inside `prefix` (such as `ip netns exec NS`) when given; fail
    with the end of the server's log if `process` ends or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while subprocess.run([*prefix, sys.executable, "-c", PROBE, url], capture_output=True,
                         check=False).returncode:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up: {log_path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.5)


@contextlib.contextmanager
def mlflow_server(directory, host="127.0.0.1", port=None, prefix=(), app_name=None):
    """A real tracking server with its own SQLite store and proxied artifact store in `directory`, started
    under `prefix` when given (and as MLflow's `--app-name` app, such as basic-auth); yields (url, process)
    and stops it, with its workers, afterwards."""
    port = port or free_port()
    url = f"http://{host}:{port}"
    cmd = [*prefix, sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{directory / 'server.db'}",
           "--artifacts-destination", str(directory / "artifacts"),
           *(["--app-name", app_name] if app_name else [])]
    log_path = directory / "server.log"
    with open(log_path, "wb") as log_file:
        # basic-auth's CSRF protection needs a fixed key. The server's job runner (seven huey consumers, for
        # MLflow's GenAI jobs; no tracking call uses them) would double what each server costs to start.
        server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=directory,
                                  start_new_session=True,
                                  env={**os.environ, "MLFLOW_FLASK_SERVER_SECRET_KEY": "tests-only",
                                       "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        try:
            wait_until_up(f"{url}/health", server, log_path, prefix=prefix)
            yield url, server
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


@contextlib.contextmanager
def models_serve(model_uri, directory, env):
    """The real `mlflow models serve` of `model_uri` on 127.0.0.1, run in `directory` with `env` (MLflow
    starts uvicorn from its PATH); yields (its /invocations URL, the process) and stops it afterwards."""
    port = free_port()
    log_path = Path(directory) / "serve.log"
    with open(log_path, "wb") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri,
                                   "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
                                  cwd=directory, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            wait_until_up(f"http://127.0.0.1:{port}/ping", server, log_path)
            yield f"http://127.0.0.1:{port}/invocations", server
        finally:
            server.terminate()
            server.wait(timeout=30)
