"""Benchmark the real job: run.sh (msrun) on the real data, with MLflow tracking to a real server on
127.0.0.1 and, side by side in the same invocation, with tracking off and its PyTorch DDP peer
(bench/peer_torch.py: the same network, data, data order, batch, optimizer and worker count, in a venv of
its own); print one table and the ratio torch/ours, write JSON. `make bench` makes the peer's venv.

    python bench/bench.py --data-dir ../shared/data/fashion-mnist --peer-python .venv-peer/bin/python
    python bench/bench.py --data-dir DIR --epochs 2 --workers 2 --compare-workers 1 --scaling
    python bench/bench.py --data-dir DIR --cpu-isa ALL      # without the job's default oneDNN cap (AVX2)

Figures: wall time (launch to exit), time to first step, train samples/s per epoch and overall, evaluation
time, peak memory per worker, CPU-seconds per 1,000 training samples (the whole job's CPU time, every
process), test accuracy, and the cost of MLflow logging (tracked minus untracked wall time), with the CPU
model, its ISA flags and the oneDNN ISA cap, so figures from different hosts compare. --compare-workers adds
runs with other worker counts for the same total work (same global batch); --scaling adds one worker at the
same per-worker batch and prints how many times its throughput the workers reach. Then the tracked run's
model is served by the real `mlflow models serve` and loaded by 1 and 16 clients with batches of 1 and 64
images (bench/serving.py): requests/s and p50/p99 latency; --serving-requests 0 skips it.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil  # installed with mlflow

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# The job's package and the tests' servers, from this checkout.
from fmnist import common, fetch, tracking  # noqa: E402
from servers import mlflow_server  # noqa: E402

import serving  # noqa: E402 (beside this file)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("DATA_DIR", "data")),
                        help="Fashion-MNIST IDX files [DATA_DIR; default: data]")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run (default: 10)")
    parser.add_argument("--workers", type=int, default=2, help="msrun workers (default: 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size per worker (default: 64)")
    parser.add_argument("--compare-workers", type=int, nargs="*", default=[],
                        help="also run untracked with these worker counts, same global batch")
    parser.add_argument("--scaling", action="store_true",
                        help="also run 1 worker at the same per-worker batch and report the speed-up")
    parser.add_argument("--cpu-isa", default=os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                        help="oneDNN ISA cap for the jobs (ONEDNN_MAX_CPU_ISA), such as AVX2, AVX512_CORE or "
                             "ALL for none; default: the job's own (AVX2 on x86-64)")
    parser.add_argument("--peer-python", default=str(ROOT / ".venv-peer" / "bin" / "python"),
                        help="the Python of the PyTorch peer's venv (default: .venv-peer/bin/python, as make "
                             "bench makes it); empty: the job alone")
    parser.add_argument("--pairs", type=int, default=1,
                        help="untracked runs of the job, each followed by one of the peer; the ratio is "
                             "taken pair by pair, so a drifting machine moves both alike (default: 1)")
    parser.add_argument("--sync-lines", type=int, default=10_000,
                        help="metric lines in a journal that `python -m fmnist.tracking sync` sends to the "
                             "server (default: 10000; 0 skips)")
    parser.add_argument("--serving-requests", type=int, default=300,
                        help="requests per serving cell (batch 1 and 64, 1 and 16 clients); 0 skips serving "
                             "(default: 300)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "bench.json",
                        help="where to write the results (default: bench/results/bench.json)")
    args = parser.parse_args(argv)
    if args.peer_python and not (Path(args.peer_python).parent / "torchrun").exists():
        parser.error(f"--peer-python {args.peer_python}: no PyTorch venv there; make bench makes it "
                     "(pip install -r bench/requirements-peer.txt in a venv of its own)")
    for name in ("epochs", "workers", "batch_size", "pairs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def test_images(data_dir):
    """The real test images, [N, 28, 28] uint8, through the job's own IDX reader."""
    kind = "images-idx3-ubyte"
    return fetch.parse_idx(fetch.local_copy(data_dir, f"t10k-{kind}").read_bytes(), kind)


def cpu_seconds(pid):
    """CPU time used so far by a process and its children (the server forks workers)."""
    process = psutil.Process(pid)
    processes = [process, *process.children(recursive=True)]
    return sum(p.cpu_times().user + p.cpu_times().system for p in processes)


def wait_until_idle(pid, timeout=120):
    """A server still starting its helper processes would steal CPU from the first job on a small machine."""
    deadline = time.monotonic() + timeout
    before = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(2)
        now = cpu_seconds(pid)
        if now - before < 0.1:
            return
        before = now


def run_job(name, workdir, args, workers, batch_size, env_extra):
    """One real job through run.sh, in a directory of its own (so a local mlflow.db is new); returns its
    summary.json plus the launch-to-exit wall time."""
    workdir = workdir / name
    workdir.mkdir()
    out = workdir / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update({"WORKERS": str(workers), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
                "MPLBACKEND": "Agg", **env_extra})
    if args.cpu_isa:
        env["ONEDNN_MAX_CPU_ISA"] = args.cpu_isa
    cmd = [str(ROOT / "run.sh"), "--data-dir", str(args.data_dir.resolve()), "--output-dir", str(out),
           "--epochs", str(args.epochs), "--batch-size", str(batch_size), "--resume", "never"]
    print(f"bench: {name}: {workers} worker(s), batch {batch_size} each, {args.epochs} epochs", flush=True)
    launched, started, cpu_before = time.time(), time.perf_counter(), children_cpu_s()
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, check=False)
    wall, cpu = time.perf_counter() - started, children_cpu_s() - cpu_before
    if result.returncode != 0:
        raise SystemExit(f"bench: {name} failed (status {result.returncode}):\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    trained = sum(e["train_samples_per_s"] * e["train_s"] for e in summary["epoch_history"])
    return {"name": name, "workers": workers, "batch_size": batch_size, "launch_wall_s": wall, "cpu_s": cpu,
            "cpu_s_per_1000_samples": cpu / trained * 1000,
            "launch_to_first_step_s": summary["first_step_at"] - launched, **summary}


def run_peer(name, workdir, args):
    """One run of the PyTorch DDP peer with torchrun; returns its JSON plus the launch-to-exit wall time."""
    out = workdir / f"{name}.json"
    cmd = [str(args.peer_python), "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.workers}", str(ROOT / "bench" / "peer_torch.py"),
           "--data-dir", str(args.data_dir.resolve()), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--json", str(out)]
    print(f"bench: {name}: PyTorch DDP, {args.workers} worker(s), batch {args.batch_size} each, "
          f"{args.epochs} epochs", flush=True)
    launched, started = time.time(), time.perf_counter()
    result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, check=False,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise SystemExit(f"bench: {name} failed (status {result.returncode}):\n{result.stderr[-3000:]}")
    peer = json.loads(out.read_text())
    return {"name": name, "launch_wall_s": time.perf_counter() - started,
            "launch_to_first_step_s": peer["first_step_at"] - launched, **peer}


def sync_s(workdir, url, lines):
    """Seconds that `python -m fmnist.tracking sync` takes to send a journal of a run's start, `lines`
    metric lines of two values (as the job writes them every log interval) and its end: the catch-up after an
    outage."""
    out = workdir / "sync"
    out.mkdir()
    journal = tracking.Journal(out / tracking.JOURNAL)
    journal.append("start", experiment="bench-sync", run_name="", params={}, datasets=[], tags={},
                   continues=False)
    for step in range(lines):
        journal.append("metrics", step=step, timestamp=int(time.time() * 1000),
                       values={"train_loss": 1 / (step + 1), "train_samples_per_s": 1000.0})
    journal.append("end", status="FINISHED")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fmnist.tracking", "sync", str(out)], cwd=ROOT, check=True,
                   env={**os.environ, "MLFLOW_TRACKING_URI": url}, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def children_cpu_s():
    """User and system CPU time of every finished descendant: run.sh, msrun, its scheduler and workers."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def table(runs):
    rows = [("run", "wall s", "first step s", "job's first step s", "train samples/s", "per epoch", "eval s",
             "CPU s/1k samples", "peak MB/worker", "test acc")]
    for run in runs:
        if "epoch_history" not in run:  # the peer
            rows.append((run["name"], f"{run['launch_wall_s']:.1f}", f"{run['launch_to_first_step_s']:.1f}",
                         "-", f"{run['train_samples_per_s']:,.0f}",
                         " ".join(f"{e['train_samples_per_s']:,.0f}" for e in run["epochs"]), "-", "-", "-",
                         f"{run['test_accuracy']:.4f}"))
            continue
        per_epoch = " ".join(f"{e['train_samples_per_s']:,.0f}" for e in run["epoch_history"])
        rows.append((run["name"], f"{run['launch_wall_s']:.1f}", f"{run['launch_to_first_step_s']:.1f}",
                     f"{run['first_step_s']:.1f}", f"{run['train_samples_per_s']:,.0f}", per_epoch,
                     f"{sum(e['eval_s'] for e in run['epoch_history']):.1f}",
                     f"{run['cpu_s_per_1000_samples']:.3f}", f"{max(run['peak_rss_mb_per_rank']):,.0f}",
                     f"{run['test_accuracy']:.4f}"))
    return aligned(rows)


def aligned(rows):
    """Rows of strings as text columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows)


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        workdir = Path(tmp)
        pairs = []  # (the job untracked, its PyTorch peer), run in turn
        for i in range(args.pairs):
            suffix = f"-{i + 1}" if args.pairs > 1 else ""
            ours = run_job(f"untracked{suffix}", workdir, args, args.workers, args.batch_size,
                           {"TRACKING": "off"})
            peer = run_peer(f"pytorch-ddp{suffix}", workdir, args) if args.peer_python else None
            pairs.append((ours, peer))
        untracked = pairs[0][0]
        with mlflow_server(workdir) as (url, server):
            wait_until_idle(server.pid)
            server_cpu = cpu_seconds(server.pid)
            tracked = run_job("tracked", workdir, args, args.workers, args.batch_size,
                              {"MLFLOW_TRACKING_URI": url, "TRACKING": "on"})
            # The server shares this machine's cores with the job; a real deployment runs it elsewhere.
            tracked["server_cpu_s"] = cpu_seconds(server.pid) - server_cpu
            synced = sync_s(workdir, url, args.sync_lines) if args.sync_lines else None
            served = []
            if args.serving_requests:
                print(f"bench: serving: the tracked run's model, {args.serving_requests} requests per cell",
                      flush=True)
                served = serving.measure(f"runs:/{tracked['mlflow_run_id']}/model", workdir, url,
                                         test_images(args.data_dir), args.serving_requests)
        # The job's own MLflow store, made new by the job in its working directory.
        local = run_job("tracked-local-store", workdir, args, args.workers, args.batch_size,
                        {"TRACKING": "on"})
        runs = [*(run for pair in pairs for run in pair if run), tracked, local]
        global_batch = args.workers * args.batch_size
        for workers in args.compare_workers:
            runs.append(run_job(f"{workers}-worker", workdir, args, workers, global_batch // workers,
                                {"TRACKING": "off"}))
        if args.scaling:
            single = run_job("1-worker-same-batch", workdir, args, 1, args.batch_size, {"TRACKING": "off"})
            runs.append(single)
    cpu = untracked["cpu"]
    print(f"\nhost: {cpu['model']}, {os.cpu_count()} cores, ISA flags {' '.join(cpu['flags']) or '-'}, "
          f"oneDNN ISA cap {cpu['onednn_isa_cap'] or 'none'}, {cpu['threads_per_worker']} thread(s) per "
          "worker")
    overhead = (tracked["launch_wall_s"] - untracked["launch_wall_s"]) / untracked["launch_wall_s"]
    print()
    print(table(runs))
    print("\nthe job's start, by phase (s):")
    for run in (r for r in runs if "startup_phases_s" in r):
        phases = ", ".join(f"{phase} {s:.1f}" for phase, s in run["startup_phases_s"].items())
        print(f"  {run['name']}: {phases}")
    print(f"\nMLflow logging overhead: {overhead:+.1%} of wall time "
          f"({tracked['launch_wall_s']:.1f} s tracked vs {untracked['launch_wall_s']:.1f} s untracked); "
          f"the tracking server used {tracked['server_cpu_s']:.1f} CPU-s of this machine meanwhile")
    ratios = sorted(peer["train_samples_per_s"] / ours["train_samples_per_s"] for ours, peer in pairs if peer)
    if ratios:
        print(f"\nPyTorch DDP / this job, train samples/s: {' '.join(f'{r:.2f}' for r in ratios)} (median "
              f"{ratios[len(ratios) // 2]:.2f}; torch {pairs[0][1]['torch_version']}, gloo, 1 thread per "
              "worker)")
    if synced is not None:
        print(f"\nsync: {args.sync_lines:,} metric lines of a journal sent in {synced:.1f} s")
    if served:
        print(f"\nthe served model (mlflow models serve, {args.serving_requests} requests per row):")
        print(aligned(serving.rows(served)))
    results = {"epochs": args.epochs, "mlflow_overhead": overhead, "host": cpu, "runs": runs,
               "serving": served, "torch_over_ours": ratios, "sync_s": synced, "sync_lines": args.sync_lines}
    if args.scaling:
        results["scaling"] = untracked["train_samples_per_s"] / single["train_samples_per_s"]
        print(f"scaling: {args.workers} workers train at {results['scaling']:.2f}x the samples/s of 1 worker "
              f"(batch {args.batch_size} per worker in both)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    common.write_atomic(args.json, (json.dumps(results, indent=2) + "\n").encode())
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
