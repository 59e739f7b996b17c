"""Data parallelism across the msrun job: joining it, the collectives the job needs, the replicas' weight check,
and the agreement by which every rank stops at the same step on SIGTERM."""

import concurrent.futures
import hashlib
import os
import signal
import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops
from mindspore.communication import get_group_size, get_rank, init

from . import common

GRADIENT_FUSION = {"allreduce": {"mode": "size", "config": 32}}  # MB per fused all-reduce
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A node learns that every node has joined, and leaves the job, at its heartbeat to msrun's scheduler: by
# default every 3 to 5 s, which held each start and each exit for seconds. One beat a second, unless set.
HEARTBEAT_S = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
POLL_S = 0.2  # between the small gathers of Collective.wait_for


def init_distributed():
    """Join the msrun job if there is one; returns (rank, local_rank, world_size), (0, 0, 1) for a lone
    process. msrun numbers the workers of each node from 0 in DEVICE_ID."""
    if "MS_ROLE" not in os.environ:
        return 0, 0, 1
    # The backend follows the device: HCCL on Ascend, MindSpore's CPU collective (mccl) on CPU.
    # msrun's scheduler process never returns from here, which is why nothing costly happens before it.
    if not any(name in os.environ for name in HEARTBEAT_S):  # MindSpore needs lower <= upper: both or neither
        os.environ.update(HEARTBEAT_S)
    init()
    world_size = get_group_size()
    # Averaged gradients, in one fused all-reduce for all of LeNet's gradients (240 KB) instead of one per
    # parameter.
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=world_size, comm_fusion=GRADIENT_FUSION)
    return get_rank(), int(os.environ.get("DEVICE_ID", "0")), world_size


class Collective:
    """The two collectives the job needs, for any world size, on numpy arrays, and who does what: rank 0
    writes the job's results, each node's first worker makes the data available on its node.

    AllGather is used for reductions too because on CPU AllReduce only takes float32, and the gathered
    rows also give the per-rank view for free.
    """

    def __init__(self, rank, local_rank, world_size):
        self.rank, self.world_size = rank, world_size
        self.is_main = rank == 0
        self.is_local_main = local_rank == 0
        self._gather = ops.AllGather() if world_size > 1 else None

    def all_gather(self, array):
        """Rows of every rank, stacked: shape (world_size, *array.shape)."""
        array = np.asarray(array)
        if self._gather is None:
            return array[None]
        return self._gather(Tensor(array[None])).asnumpy()

    def wait_for(self, work=None):
        """Run `work` (None: nothing) on this rank while every rank polls with small gathers until every rank's
        work is done, then return its result or raise its error. MindSpore's CPU collective fails a receive that
        waits longer than MS_NODE_TIMEOUT (run.sh sets 5 s, so that a dead worker ends the job fast): a rank
        that waits for another's long work (a download, MLflow, a checkpoint) must not wait in one collective.
        UsageError on the ranks whose own work went well when another rank's failed."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(work) if work else None
            while True:
                state = 0 if future and not future.done() else 2 if future and future.exception() else 1
                states = self.all_gather(np.array([state], dtype=np.int32))
                if states.all():
                    break
                time.sleep(POLL_S)
        if future:
            result = future.result()  # this rank's error, if it failed
        if (states == 2).any():
            time.sleep(1)  # the failed rank exits first, so msrun and run.sh report its status and its log
            failed = int(np.argmax(states == 2))
            raise common.UsageError(f"rank {failed} failed (its log says why); this rank stops too")
        return result if future else None

    def broadcast_text(self, text, length=64):
        """Rank 0's `text` (ASCII, at most `length` characters) on every rank."""
        codes = np.zeros(length, dtype=np.int32)
        codes[:len(text or "")] = list((text or "").encode("ascii"))
        return bytes(self.all_gather(codes)[0].astype(np.uint8)).rstrip(b"\0").decode("ascii")


def weights_fingerprint(net):
    """SHA-256 of every parameter's bytes in a fixed order, as 8 int32 for a collective."""
    digest = hashlib.sha256()
    for param in sorted(net.trainable_params(), key=lambda p: p.name):
        digest.update(param.name.encode())
        digest.update(param.asnumpy().tobytes())
    return np.frombuffer(digest.digest(), dtype=np.int32)


def replicas_identical(collective, net):
    """Whether every rank ends with bit-identical weights, and each rank's fingerprint. A collective."""
    fingerprints = collective.all_gather(weights_fingerprint(net))
    return bool((fingerprints == fingerprints[0]).all()), fingerprints


class Terminated(Exception):
    """SIGTERM or SIGINT asked the job to stop; every rank stops at the same step."""

    def __init__(self, signum, step):
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}")
        self.signum, self.step = signum, step


class StopRequest:
    """Turns SIGTERM and SIGINT during training into a request that the ranks agree on at the next log
    interval (a rank stopping alone would leave the others waiting in a collective). Outside training the
    signals keep their default effect: the process ends at once, and everything it writes is atomic."""

    def __init__(self):
        self.signum = 0

    def __enter__(self):
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc_info):
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    def _record(self, signum, frame):
        self.signum = signum
