"""The device and the CPU under it: Ascend or CPU, oneDNN's instruction-set cap, and each worker's own cores
and threads."""

import logging
import math
import os
import platform
from pathlib import Path

import mindspore as ms

# oneDNN picks slow convolutions for LeNet's small NCHW float32 shapes on AVX-512 CPUs; its AVX2 kernels are
# several times faster (docs/performance.md). A user's own cap wins.
ONEDNN_ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_ISA_DEFAULT = "AVX2"
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")


def resolve_device(requested):
    if requested != "auto":
        return requested
    # is_available() warns about the missing Ascend plugin on every CPU machine; that is the expected case here.
    quiet = logging.getLogger(ms.log._get_logger().name)  # pylint: disable=protected-access
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return "Ascend" if ms.device_context.ascend.is_available() else "CPU"
    finally:
        quiet.setLevel(level)


def usable_cores(cgroup_cpu_max="/sys/fs/cgroup/cpu.max"):
    """The cores this process may use: its affinity, cut to its cgroup's CPU quota (a Kubernetes CPU limit
    leaves every core of the node in the affinity mask but only the quota's worth of time)."""
    cores = sorted(os.sched_getaffinity(0))
    try:
        quota, period = Path(cgroup_cpu_max).read_text().split()
        return cores[:max(1, math.ceil(int(quota) / int(period)))]
    except (OSError, ValueError):  # no cgroup v2, or "max": no quota
        return cores


def worker_cores(cores, local_rank, local_workers):
    """This worker's share of `cores`: disjoint blocks, one per worker of this machine, or one core each in
    turn when there are more workers than cores."""
    if len(cores) < local_workers:
        return [cores[local_rank % len(cores)]]
    share = len(cores) // local_workers
    return cores[local_rank * share:(local_rank + 1) * share]


def bind_to_cores(cores):
    """Bind the calling thread, and so every thread it starts later (MindSpore's kernel and runtime pools, the
    data pipeline), to `cores`.

    MindSpore's runtime and kernel threads spin in sched_yield while they wait; unbound, two workers' spinning
    threads take turns with each other's kernels and two workers on two cores train barely faster than one.
    Bound, each worker's threads yield only to each other. The threads that already run are left on every core:
    after init() they are the CPU collective's, and bound they would take a peer's gradients only when this
    worker's spinning threads let them (docs/performance.md).
    """
    os.sched_setaffinity(0, cores)


def cap_onednn_isa(environ=os.environ, machine=None):
    """The instruction-set cap oneDNN will use: the user's ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA, else AVX2 on
    x86-64 (set here, in this process: oneDNN reads it once, at MindSpore's first CPU kernel). None elsewhere."""
    for name in ONEDNN_ISA_VARS:
        if environ.get(name):
            return environ[name]
    if (machine or platform.machine()).lower() not in ("x86_64", "amd64"):
        return None
    environ["ONEDNN_MAX_CPU_ISA"] = ONEDNN_ISA_DEFAULT
    return ONEDNN_ISA_DEFAULT


def cpu_description(cpuinfo="/proc/cpuinfo"):
    """{"model": ..., "flags": [...]}: the CPU model and the ISA flags that decide oneDNN's kernels, so
    figures from different hosts can be compared."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return {"model": platform.processor() or platform.machine(), "flags": []}
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", platform.machine()),
            "flags": [flag for flag in CPU_FLAGS_OF_INTEREST if flag in flags]}


def set_up_worker(device, local_rank, local_workers, bind, threads):
    """Give this worker its share of the machine: its cores (on CPU bound to them when `bind`, before MindSpore
    starts the thread pools that inherit the binding) and `threads` threads, or one per core of its share, for
    the kernels and the data pipeline. Returns the thread count."""
    cores = worker_cores(usable_cores(), local_rank, local_workers)
    threads = threads or len(cores)
    if device == "CPU":
        if bind:
            bind_to_cores(cores)
        ms.device_context.cpu.op_tuning.threads_num(threads)
    ms.dataset.config.set_num_parallel_workers(threads)
    return threads
