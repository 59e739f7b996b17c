"""The served model under load: the real `mlflow models serve` on a run's model, asked by 1 and by 16 clients
at once for batches of 1 and of 64 test images. Requests/s and latency percentiles per cell.

The clients are threads of this process on the same machine as the server, so on a small machine they take
some of its cores: the figures are a floor for a server with the machine to itself.
"""

import json
import os
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from servers import models_serve

CELLS = [(batch, clients) for batch in (1, 64) for clients in (1, 16)]


def timed_request(url, body):
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}")
    return time.perf_counter() - started


def load(url, images, batch, clients, requests):
    """`requests` requests of `batch` images from `clients` concurrent clients, after a warm-up."""
    bodies = [json.dumps({"inputs": images[(i * batch) % (len(images) - batch):][:batch].tolist()}).encode()
              for i in range(requests)]
    for body in bodies[:clients]:
        timed_request(url, body)
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = sorted(pool.map(lambda body: timed_request(url, body), bodies))
    elapsed = time.perf_counter() - started
    quantiles = statistics.quantiles(latencies, n=100)
    return {"batch": batch, "clients": clients, "requests": requests, "requests_per_s": requests / elapsed,
            "images_per_s": requests * batch / elapsed, "p50_ms": quantiles[49] * 1000,
            "p99_ms": quantiles[98] * 1000}


def measure(model_uri, workdir, tracking_uri, images, requests):
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri,  # mlflow models serve runs uvicorn from PATH
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with models_serve(model_uri, workdir, env) as (url, _):
        return [load(url, images, batch, clients, requests) for batch, clients in CELLS]


def rows(cells):
    """The table's rows, header first."""
    return [("images/request", "clients", "requests/s", "images/s", "p50 ms", "p99 ms")] + [
        (str(c["batch"]), str(c["clients"]), f"{c['requests_per_s']:,.0f}", f"{c['images_per_s']:,.0f}",
         f"{c['p50_ms']:.1f}", f"{c['p99_ms']:.1f}") for c in cells]
