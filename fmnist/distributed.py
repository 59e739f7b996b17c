"""This worker's place in the msrun job (join_job): its device and CPU share, joining, the collectives and the
figures they gather (the test set's, the replicas' weights), and the stop request the ranks agree on."""

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
from scipy.special import log_softmax

import mindspore as ms
from mindspore import Tensor, ops
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import Metric

from . import common, settings
from .common import log

# oneDNN picks slow convolutions for LeNet's small NCHW float32 shapes on AVX-512 CPUs; its AVX2 kernels are
# several times faster (docs/performance.md). A user's own cap wins.
ONEDNN_ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
GRADIENT_FUSION = {"allreduce": {"mode": "size", "config": 32}}  # MB of gradients in one fused all-reduce
# A node learns that every node has joined, and leaves the job, at its heartbeat to msrun's scheduler: by
# default every 3 to 5 s, which held each start and each exit for seconds. One beat a second, unless set.
HEARTBEAT_S = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
POLL_S = 0.2  # seconds between the small gathers of Collective.wait_for
SCHEDULER_WAIT_S = 10  # for msrun's scheduler to listen, before init() tries on its own


def cap_onednn_isa(environ=os.environ, machine=None):
    """oneDNN's ISA cap: the user's, else AVX2 on x86-64 (before the first CPU kernel), else None."""
    for name in ONEDNN_ISA_VARS:
        if environ.get(name):
            return environ[name]
    if (machine or platform.machine()).lower() not in ("x86_64", "amd64"):
        return None
    environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    return "AVX2"


def cpu_description(cpuinfo="/proc/cpuinfo"):
    """The CPU model and the ISA flags that decide oneDNN's kernels, so figures from two hosts compare."""
    first_cpu = Path(cpuinfo).read_text().split("\n\n")[0]
    pairs = (line.partition(":") for line in first_cpu.splitlines())
    fields = {key.strip(): value.strip() for key, _, value in pairs}
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", platform.machine()),
            "flags": [flag for flag in CPU_FLAGS_OF_INTEREST if flag in flags]}


def usable_cores(cgroup_cpu_max="/sys/fs/cgroup/cpu.max"):
    """This process's cores, cut to its cgroup's CPU quota: a Kubernetes CPU limit leaves every core in the
    affinity mask but only the quota's worth of time."""
    cores = sorted(os.sched_getaffinity(0))
    try:
        quota, period = Path(cgroup_cpu_max).read_text().split()
        return cores[:max(1, math.ceil(int(quota) / int(period)))]
    except (OSError, ValueError):  # no cgroup v2, or "max": no quota
        return cores


def worker_cores(cores, local_rank, local_workers):
    """Disjoint blocks of `cores`, one per worker of this machine; one core each in turn if they are fewer."""
    if len(cores) < local_workers:
        return [cores[local_rank % len(cores)]]
    share = len(cores) // local_workers
    return cores[local_rank * share:(local_rank + 1) * share]


def set_up_worker(device, local_rank, local_workers, bind, threads):
    """Bind this worker to its cores before MindSpore's pools start; its `threads` threads, or one a core."""
    cores = worker_cores(usable_cores(), local_rank, local_workers)
    threads = threads or len(cores)
    if device == "CPU":
        # MindSpore's threads spin as they wait: unbound, two workers' threads preempt each other's kernels.
        if bind:
            os.sched_setaffinity(0, cores)
        ms.device_context.cpu.op_tuning.threads_num(threads)
    ms.dataset.config.set_num_parallel_workers(threads)
    return threads


def is_scheduler():
    """Whether this process is msrun's scheduler, which runs main.py too and stays in init()."""
    return os.environ.get("MS_ROLE") == "MS_SCHED"


def wait_for_scheduler(timeout_s=SCHEDULER_WAIT_S):
    """Until msrun's scheduler takes connections, or `timeout_s` (then init() waits on its own terms). init()
    tries again only half a second after a refusal; workers let in together are ready together, and then
    often miss the 3 s that MindSpore's CPU collective sleeps when a peer's address is not in yet."""
    host, port = os.environ.get("MS_SCHED_HOST"), os.environ.get("MS_SCHED_PORT", "")
    deadline = time.monotonic() + timeout_s
    while host and port.isdigit() and time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.02)


def init_distributed():
    """Join the msrun job (HCCL on Ascend, MindSpore's collective on CPU): (rank, local rank, world size), or
    (0, 0, 1) alone. msrun's scheduler process stays in init(): nothing costly comes before."""
    if "MS_ROLE" not in os.environ:
        return 0, 0, 1
    if not any(name in os.environ for name in HEARTBEAT_S):  # MindSpore needs lower <= upper: both or neither
        os.environ.update(HEARTBEAT_S)
    if not is_scheduler():
        wait_for_scheduler()
    try:
        init()
    except RuntimeError as exc:
        if not is_scheduler():
            raise
        # A worker ended the job, and its own log says why: the scheduler ends in one line, no traceback, and
        # at once, as an uncaught error would (a normal exit waits for MindSpore's finalizers for seconds).
        print(f"msrun's scheduler: the job ended early: {common.first_line(exc)}", file=sys.stderr,
              flush=True)
        os._exit(1)
    world_size = get_group_size()
    # Averaged gradients, in one fused all-reduce for all of LeNet's (240 KB) instead of one per parameter.
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=world_size, comm_fusion=GRADIENT_FUSION)
    return get_rank(), int(os.environ.get("DEVICE_ID", "0")), world_size  # msrun numbers a node's workers


class Collective:
    """The job's collectives on numpy arrays, and who does what: rank 0 writes, each node's first worker
    fetches. AllGather serves for reductions too: on CPU AllReduce takes only float32."""

    def __init__(self, rank, local_rank, world_size):
        self.rank, self.world_size = rank, world_size
        self.is_main, self.is_local_main = rank == 0, local_rank == 0
        self._gather = ops.AllGather() if world_size > 1 else None

    def all_gather(self, array):
        """Rows of every rank, stacked: shape (world_size, *array.shape)."""
        array = np.asarray(array)
        return array[None] if self._gather is None else self._gather(Tensor(array[None])).asnumpy()

    def wait_for(self, work=None):
        """`work`'s result, while every rank polls with small gathers till all are done (MindSpore's CPU
        collective fails a receive after MS_NODE_TIMEOUT); its error on its rank, UsageError on others."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(work) if work else None
            while True:
                state = 0 if future and not future.done() else 2 if future and future.exception() else 1
                states = self.all_gather(np.array([state], dtype=np.int32))
                if states.all():
                    break
                time.sleep(POLL_S)
        result = future.result() if future else None  # raises this rank's error
        if (states == 2).any():
            # The failed rank exits first, so that msrun and run.sh report its status and its log.
            time.sleep(1)
            failed = int(np.argmax(states == 2))
            raise common.UsageError(f"rank {failed} failed (its log says why); this rank stops too")
        return result


@dataclasses.dataclass(frozen=True)
class Job:
    """The settings, what this worker resolved from them, and its place in the msrun job."""

    cfg: settings.Config
    checksums: dict
    device: str
    amp_level: str
    loss_scaling: str
    cpu: dict  # the CPU's model, ISA flags and oneDNN's cap on them, this worker's threads
    collective: Collective
    local_workers: int
    output_lock: object  # rank 0's, held until the process ends, however it ends

    @property
    def resolved(self):
        """What the run records beside the settings, and a resume must match."""
        return {"device": self.device, "world_size": self.collective.world_size, "amp_level": self.amp_level,
                "loss_scaling": self.loss_scaling}


def join_job(cfg, checksums):
    """Graph mode on the device, init() of the msrun job, identical seeds, and this worker's share of the CPU.
    msrun's scheduler process stays in init() until the job ends."""
    device = settings.resolve_device(cfg.device)
    amp_level, loss_scaling = settings.resolve_precision(cfg.amp, cfg.loss_scale, device)
    isa_cap = cap_onednn_isa() if device == "CPU" else None
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(device)
    rank, local_rank, world_size = init_distributed()
    common.configure_logging(rank)
    local_workers = int(os.environ.get("LOCAL_WORKERS") or world_size)
    threads = set_up_worker(device, local_rank, local_workers, cfg.cpu_bind == "on", cfg.threads)
    # Identical initial weights on every replica: MindSpore does not broadcast them.
    ms.set_seed(cfg.seed)
    cpu = {**cpu_description(), "onednn_isa_cap": isa_cap, "threads_per_worker": threads}
    lock = common.hold_lock(cfg.output_dir / ".lock", f"--output-dir {cfg.output_dir}") if rank == 0 else None
    job = Job(cfg, checksums, device, amp_level, loss_scaling, cpu,
              Collective(rank, local_rank, world_size), local_workers, lock)
    # Every rank says who it is: run.sh finds a failed worker's log by the pid msrun reports.
    log.info("rank %d of %d (pid %d), device %s, amp %s, loss scale %s, %d threads on cores %s, oneDNN ISA "
             "cap %s, settings %s", rank, world_size, os.getpid(), device, amp_level, loss_scaling, threads,
             sorted(os.sched_getaffinity(0)), isa_cap, json.dumps(dataclasses.asdict(cfg), default=str))
    return job


class Evaluation(Metric):
    """The loss, the accuracy and the confusion matrix (rows: the true class) over the whole test set: each
    rank scores its slice, one gather sums the counts, so a figure is the job's, not rank 0's alone."""

    def __init__(self, collective, num_classes):
        super().__init__()
        self._collective, self._num_classes = collective, num_classes
        self.clear()

    def clear(self):
        self._loss, self._confusion = 0.0, np.zeros((self._num_classes, self._num_classes), dtype=np.int64)

    def update(self, *inputs):  # logits and one-hot labels, as Model.eval passes them
        logits, labels = inputs[0].asnumpy().astype(np.float64), inputs[1].asnumpy()
        self._loss -= float((labels * log_softmax(logits, axis=1)).sum())  # the cross-entropy, stably
        np.add.at(self._confusion, (labels.argmax(axis=1), logits.argmax(axis=1)), 1)

    def eval(self):
        # float64 holds the counts exactly: one gather carries the loss and the matrix.
        rows = self._collective.all_gather(np.append(self._loss, self._confusion).astype(np.float64))
        total = rows.sum(axis=0)
        confusion = total[1:].reshape(self._confusion.shape).astype(np.int64)
        count = max(int(confusion.sum()), 1)
        return {"loss": total[0] / count, "accuracy": np.trace(confusion) / count, "confusion": confusion}


def replicas_identical(collective, net):
    """Whether every rank ends with bit-identical weights, and each rank's fingerprint: the SHA-256 of every
    parameter's name and bytes in name order, as 8 int32 for the gather. A collective."""
    digest = hashlib.sha256()
    for param in sorted(net.trainable_params(), key=lambda p: p.name):
        digest.update(param.name.encode() + param.asnumpy().tobytes())
    fingerprints = collective.all_gather(np.frombuffer(digest.digest(), dtype=np.int32))
    return bool((fingerprints == fingerprints[0]).all()), fingerprints


# MindSpore's words for a rank gone (its node lost, or its process killed): the cluster's state, which a
# collective checks when a peer stops answering, or the collective's own failure when its connection breaks.
PEER_LOST = re.compile(r"The state of the cluster is error[^\n]*"
                       r"|Launch kernel failed[^\n]*?(AllReduce|AllGather|Broadcast|ReduceScatter)[\w-]*")


def peer_lost(exc):
    """The line of MindSpore's error that says a rank of the job is gone, or None."""
    match = PEER_LOST.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return match and match[0]


class Terminated(Exception):
    def __init__(self, signum, step):
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}")
        self.signum = signum


class StopRequest:
    """SIGTERM and SIGINT from training on, recorded for the ranks to agree on at a log interval (one rank
    stopping alone would hang the others in a collective). Before, they end the process: writes are atomic."""

    signum = 0

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc_info):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def _record(self, signum, frame):
        self.signum = signum
