"""Data-parallel LeNet on Fashion-MNIST with MindSpore, launched by msrun and tracked in MLflow.

Run it (Ascend NPUs with HCCL when present, MindSpore's own CPU collective otherwise; same file):

    python main.py                                                        # one process
    msrun --worker_num=2 --local_worker_num=2 --join=True python main.py  # two data-parallel workers
    ./run.sh                                                              # msrun with workers detected

Every setting is a flag and an environment variable (`python main.py --help`); the ones that matter:
--epochs (10), --batch-size per device (64), --lr (0.1), --optimizer (sgd), --amp (auto: O2 on Ascend,
O0 on CPU), --loss-scale (auto: dynamic for O2 on Ascend, none elsewhere), --data-dir (./data),
--output-dir (./outputs).

Expect, with the defaults and two CPU workers: 10 epochs, test accuracy about 0.87-0.89 on the full test
set, identical weights on every replica, and `outputs/summary.json` holding those figures.
"""

import argparse
import collections
import dataclasses
import fcntl
import functools
import gzip
import hashlib
import io
import itertools
import json
import logging
import math
import os
import platform
import queue
import resource
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import Callback, Metric, Model

log = logging.getLogger("fashion-mnist")

# --- config

JOB_VERSION = "1.0.0"
EXIT_USAGE = 2  # bad settings or data: retrying the same pod cannot help (see k8s-job.yaml podFailurePolicy)
EXIT_DIVERGED = 3  # the loss went non-finite: a retry with the same settings diverges again (podFailurePolicy too)
CHECKPOINT_FORMAT = 2  # 2: a checkpoint records the settings of its training; job 1.0.0 wrote format 1
# Settings a resumed job may change: where things are, how progress is shown, how long to train. Every other
# setting, and what the job resolves from them, shapes the training and must match the checkpoint.
FREE_ON_RESUME = frozenset({"epochs", "data_dir", "data_mirrors", "checksums_file", "download_timeout",
                            "download_deadline", "output_dir", "resume", "keep_checkpoints", "predict",
                            "experiment", "run_name", "tracking", "register_model", "log_interval", "threads", "cpu_bind",
                            "amp", "loss_scale"})  # the last two count as resolved: amp_level, loss_scaling
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
MLFLOW_STOP_TIMEOUT_S = 10  # what a stopped job waits for MLflow: the pod's 30 s grace period must hold it all
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IMAGE_SIZE = 28
# SHA-256 of the decompressed IDX files of the official release. Hashing the content rather than the .gz
# accepts re-compressed copies such as Debian's dataset-fashion-mnist package.
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
SYSTEM_DATA_DIRS = ("/usr/share/datasets/fashion-mnist",)  # Debian/Ubuntu package dataset-fashion-mnist
OFFICIAL_MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
DOWNLOAD_RETRIES = 3
# A transfer slower than this on average, once it has run --download-timeout seconds, is a trickle: a proxy or
# mirror that would otherwise hold the job for days, one byte per read timeout. The official mirror gives MB/s.
DOWNLOAD_MIN_BYTES_PER_S = 16 << 10
DOWNLOAD_MAX_BYTES = 64 << 20  # the largest official file is 26 MB gzipped; a wrong URL must not fill the disk
GZIP_MAGIC = b"\x1f\x8b"
IDX_MAGIC = {1: 0x00000801, 3: 0x00000803}  # unsigned bytes, by number of dimensions
# MLflow retries a dead server for minutes by default; these bound one request to about half a minute.
# Its usage telemetry would be one more thread reaching for the internet from every training pod.
# System metrics every 10 s: one psutil sample and one request, under the benchmark's noise (README).
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
                   "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "10"}
# The UI's "Model training" view (not its GenAI one) for the job's experiment.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
SERVING_EXAMPLE_IMAGES = 4  # test images stored with the MLflow model as its input example
MLFLOW_FINISH_TIMEOUT_S = 60
GRADIENT_FUSION = {"allreduce": {"mode": "size", "config": 32}}  # MB per fused all-reduce
OPTIMIZERS = ("sgd", "momentum", "adam")
AMP_LEVELS = ("auto", "O0", "O1", "O2", "O3")
# oneDNN 3.10 picks its jit_uni_ncsp convolutions for LeNet's small NCHW float32 shapes on AVX-512 CPUs: 183 ms
# per batch-64 step against 21 ms with its AVX2 kernels (README, "Performance"). A user's own cap wins.
ONEDNN_ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_ISA_DEFAULT = "AVX2"
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
DEVICES = ("auto", "Ascend", "CPU")


class UsageError(Exception):
    """A setting or the data is wrong; the message says what and how to fix it."""


class Diverged(Exception):
    """The training loss stopped being finite."""


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


def env_name(flag):
    """The environment variable behind a flag: --batch-size <-> BATCH_SIZE."""
    return flag.lstrip("-").replace("-", "_").upper()


def build_parser():
    parser = argparse.ArgumentParser(
        description="Data-parallel LeNet on Fashion-MNIST (MindSpore, msrun, MLflow). "
                    "Each flag defaults from the environment variable named in brackets.")

    def add(flag, type_, default, help_, env=None, **kwargs):
        env = env or env_name(flag)
        # argparse converts a string default with `type_`, so a bad environment value fails like a bad flag.
        parser.add_argument(flag, type=type_, default=os.environ.get(env, default),
                            help=f"{help_} [{env}; default: {default}]", **kwargs)

    add("--epochs", int, 10, "training epochs in total")
    add("--batch-size", int, 64, "batch size per device; the global batch is this times the world size")
    add("--lr", float, 0.1, "learning rate")
    add("--optimizer", str, "sgd", "optimizer", choices=OPTIMIZERS)
    add("--momentum", float, 0.9, "momentum, for --optimizer momentum")
    add("--weight-decay", float, 0.0, "L2 weight decay")
    add("--amp", str, "auto", "mixed-precision level; auto is O2 on Ascend and O0 on CPU", choices=AMP_LEVELS)
    add("--loss-scale", str, "auto", "loss scaling: none, dynamic (Ascend only), or a number for a fixed scale; "
                                     "auto is dynamic for O2 on Ascend and none otherwise, as in the article")
    add("--device", str, "auto", "device; auto picks Ascend when present, else CPU", choices=DEVICES)
    add("--seed", int, 42, "random seed; the same on every rank so all replicas start identical")
    add("--data-dir", Path, "data", "where Fashion-MNIST is, or is put")
    add("--data-mirrors", str, OFFICIAL_MIRROR, "base URLs to download from, comma-separated, tried in "
                                                "order after local copies; empty: never download")
    add("--checksums-file", str, "", "sha256sum-style file replacing the pinned checksums of the four IDX "
                                     "files (to train on another IDX dataset)")
    add("--download-timeout", float, 30.0, "seconds without progress before a download attempt is abandoned")
    add("--download-deadline", float, 600.0, "seconds one file's download may take in all, whatever its progress")
    add("--output-dir", Path, "outputs", "where summary.json, PNGs and checkpoints go")
    add("--resume", str, "auto", "auto: continue from the newest good checkpoint in the output dir; "
                                 "never: start fresh", choices=("auto", "never"))
    add("--keep-checkpoints", int, 3, "epoch checkpoints kept in <output-dir>/checkpoints")
    add("--predict", str, "", "evaluate a saved model (.ckpt or .mindir) on the test set, then exit")
    add("--experiment", str, "fashion-mnist-lenet", "MLflow experiment name", env="MLFLOW_EXPERIMENT_NAME")
    add("--run-name", str, "", "MLflow run name (default: MLflow picks one)")
    add("--tracking", str, "on", "MLflow tracking on or off", choices=("on", "off"))
    add("--register-model", str, "", "register the trained model under this name in the MLflow Model Registry "
                                     "(default: not registered)")
    add("--log-interval", int, 100, "steps between progress lines and training-loss points")
    add("--threads", int, 0, "CPU threads per worker for kernels and the data pipeline; 0: one per core of "
                             "the worker's share of this machine (see --cpu-bind)")
    add("--cpu-bind", str, "on", "on: bind each CPU worker to its own share of this machine's cores, divided "
                                 "among its workers (LOCAL_WORKERS, else the world size)", choices=("on", "off"))
    return parser


@dataclasses.dataclass(frozen=True)
class Config:
    epochs: int
    batch_size: int
    lr: float
    optimizer: str
    momentum: float
    weight_decay: float
    amp: str
    loss_scale: str
    device: str
    seed: int
    data_dir: Path
    data_mirrors: str
    checksums_file: str
    download_timeout: float
    download_deadline: float
    output_dir: Path
    resume: str
    keep_checkpoints: int
    predict: str
    experiment: str
    run_name: str
    tracking: str
    register_model: str
    log_interval: int
    threads: int
    cpu_bind: str

    @property
    def mirrors(self):
        return [url.strip() for url in self.data_mirrors.split(",") if url.strip()]


def parse_config(argv=None):
    cfg = Config(**vars(build_parser().parse_args(argv)))
    positive = {"--epochs": cfg.epochs, "--batch-size": cfg.batch_size, "--lr": cfg.lr,
                "--log-interval": cfg.log_interval, "--download-timeout": cfg.download_timeout,
                "--download-deadline": cfg.download_deadline,
                "--keep-checkpoints": cfg.keep_checkpoints}
    for flag, value in positive.items():
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value} (flag or {env_name(flag)})")
    if not 0 <= cfg.momentum < 1:
        raise UsageError(f"--momentum must be in [0, 1), got {cfg.momentum}")
    if cfg.threads < 0:
        raise UsageError(f"--threads must be >= 0, got {cfg.threads}")
    if cfg.weight_decay < 0:
        raise UsageError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    if cfg.register_model and cfg.tracking == "off":
        raise UsageError("--register-model needs tracking: drop --tracking off, or the registration")
    if cfg.loss_scale not in ("auto", "none", "dynamic") and not positive_number(cfg.loss_scale):
        raise UsageError(f"--loss-scale must be auto, none, dynamic or a positive number, got {cfg.loss_scale!r}")
    return cfg


def positive_number(text):
    try:
        return float(text) > 0
    except ValueError:
        return False


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
    """Bind every thread of this process, and so every thread it starts later, to `cores`.

    MindSpore's runtime and kernel threads spin in sched_yield while they wait; unbound, two workers' spinning
    threads take turns with each other's kernels and two workers on two cores train barely faster than one.
    Bound, each worker's threads yield only to each other.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


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


def resolve_amp(amp, device):
    # float16 pays off on Ascend's cube units; on CPU it only adds casts (measured 1.4x slower than O0).
    if amp != "auto":
        return amp
    return "O2" if device == "Ascend" else "O0"


def resolve_loss_scale(loss_scale, amp_level, device):
    """The loss scaling the job uses: "none", "dynamic", or "fixed:<scale>".

    auto follows MindSpore's own defaults per level (dynamic for O2) on Ascend. On CPU MindSpore refuses
    dynamic scaling, so auto is none there, which is what the article does with O2.
    """
    if loss_scale == "auto":
        return "dynamic" if amp_level == "O2" and device == "Ascend" else "none"
    if loss_scale == "dynamic" and device == "CPU":
        raise UsageError("--loss-scale dynamic: MindSpore supports no dynamic loss scaling on CPU; use "
                         "--loss-scale none or a fixed scale such as --loss-scale 1024")
    return loss_scale if loss_scale in ("none", "dynamic") else f"fixed:{float(loss_scale):g}"


def fixed_loss_scale(mode):
    """The scale of a "fixed:<scale>" mode, else None."""
    return float(mode.partition(":")[2]) if mode.startswith("fixed:") else None


def loss_scale_manager(mode):
    """MindSpore's manager for a resolve_loss_scale() mode; None means no scaling."""
    if mode == "none":
        return None
    if mode == "dynamic":
        return ms.amp.DynamicLossScaleManager()
    # drop_overflow_update=False is the only fixed scaling MindSpore runs on CPU, and needs no overflow check.
    return ms.amp.FixedLossScaleManager(fixed_loss_scale(mode), drop_overflow_update=False)


# --- distributed helpers


def init_distributed():
    """Join the msrun job if there is one; returns (rank, local_rank, world_size), (0, 0, 1) for a lone
    process. msrun numbers the workers of each node from 0 in DEVICE_ID."""
    if "MS_ROLE" not in os.environ:
        return 0, 0, 1
    # The backend follows the device: HCCL on Ascend, MindSpore's CPU collective (mccl) on CPU.
    # msrun's scheduler process never returns from here, which is why nothing costly happens before it.
    init()
    world_size = get_group_size()
    # One fused all-reduce for all of LeNet's gradients (240 KB) instead of one per parameter.
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=world_size, comm_fusion=GRADIENT_FUSION)
    return get_rank(), int(os.environ.get("DEVICE_ID", "0")), world_size


class Collective:
    """The two collectives the job needs, for any world size, on numpy arrays.

    AllGather is used for reductions too because on CPU AllReduce only takes float32, and the gathered
    rows also give the per-rank view for free.
    """

    def __init__(self, rank, local_rank, world_size):
        self.rank, self.world_size = rank, world_size
        self.is_main = rank == 0  # writes the job's results
        self.is_local_main = local_rank == 0  # makes the data available on its node
        self._gather = ops.AllGather() if world_size > 1 else None

    def all_gather(self, array):
        """Rows of every rank, stacked: shape (world_size, *array.shape)."""
        array = np.asarray(array)
        if self._gather is None:
            return array[None]
        return self._gather(Tensor(array[None])).asnumpy()

    def barrier(self):
        if self.world_size > 1:
            ops.communication.barrier()

    def broadcast_text(self, text, length=64):
        """Rank 0's `text` (ASCII, at most `length` characters) on every rank."""
        codes = np.zeros(length, dtype=np.int32)
        codes[:len(text or "")] = list((text or "").encode("ascii"))
        return bytes(self.all_gather(codes)[0].astype(np.uint8)).rstrip(b"\0").decode("ascii")


# --- data


def parse_idx(raw, name="IDX data"):
    """Decode an IDX file of unsigned bytes (gzipped or not) into an array; reject anything malformed."""
    if raw[:2] == GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ValueError(f"{name}: corrupt or truncated gzip ({exc})") from None
    if len(raw) < 8:
        raise ValueError(f"{name}: {len(raw)} bytes is too short for an IDX header")
    magic = int.from_bytes(raw[:4], "big")
    ndim = raw[3]
    if IDX_MAGIC.get(ndim) != magic:
        raise ValueError(f"{name}: magic number 0x{magic:08x} is not an IDX file of unsigned bytes "
                         f"(expected 0x{IDX_MAGIC[1]:08x} or 0x{IDX_MAGIC[3]:08x})")
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    if len(raw) != header + math.prod(shape):
        raise ValueError(f"{name}: header says shape {shape} ({header + math.prod(shape)} bytes) "
                         f"but the file has {len(raw)} bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def decompressed_sha256(raw):
    return hashlib.sha256(gzip.decompress(raw) if raw[:2] == GZIP_MAGIC else raw).hexdigest()


def load_checksums(path):
    """Expected SHA-256 per IDX file: the pinned official ones, or a sha256sum-style file's."""
    if not path:
        return dict(FASHION_MNIST_SHA256)
    try:
        lines = Path(path).read_text().split("\n")
    except OSError as exc:
        raise UsageError(f"--checksums-file {path}: cannot read it ({exc.strerror})") from None
    sums = {}
    for line in filter(None, (line.strip() for line in lines)):
        digest, _, name = line.partition(" ")
        sums[name.strip().lstrip("*").removesuffix(".gz")] = digest.lower()
    missing = sorted(set(FASHION_MNIST_SHA256) - set(sums))
    if missing:
        raise UsageError(f"--checksums-file {path}: no checksum for {', '.join(missing)}; "
                         "write one line '<sha256>  <file name>' per IDX file")
    return sums


def check_file(raw, name, expected_sha256):
    """Raise ValueError unless `raw` is a well-formed IDX file whose content has the expected checksum."""
    parse_idx(raw, name)
    actual = decompressed_sha256(raw)
    if actual != expected_sha256:
        raise ValueError(f"{name}: SHA-256 of the content is {actual}, expected {expected_sha256}")


def local_copy(directory, name):
    """The file for `name` in `directory` (.gz or decompressed), or None."""
    for candidate in (Path(directory) / f"{name}.gz", Path(directory) / name):
        if candidate.is_file():
            return candidate
    return None


class TooSlow(ConnectionError):
    """A transfer that trickles or outlasts its deadline: another attempt at the same mirror would too."""


def check_pace(url, size, started, timeout, deadline):
    elapsed = time.monotonic() - started
    if elapsed > deadline:
        raise TooSlow(f"{url}: not complete after {elapsed:.0f} s ({size} bytes), over --download-deadline "
                      f"{deadline:g}")
    if elapsed > timeout and size / elapsed < DOWNLOAD_MIN_BYTES_PER_S:
        raise TooSlow(f"{url}: {size / elapsed:,.0f} bytes/s after {elapsed:.0f} s, under the minimum of "
                      f"{DOWNLOAD_MIN_BYTES_PER_S:,} bytes/s")


def download(url, timeout, say=print, deadline=600.0):
    """Bytes at `url`, with retries on transient failures, a size cap, a progress line for big files, and
    bounded time: `timeout` per read, `deadline` in all, and a minimum average rate."""
    for attempt in range(1, DOWNLOAD_RETRIES + 1):
        try:
            started = time.monotonic()
            with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http(s) mirrors only)
                total = int(response.headers.get("Content-Length") or 0)
                if total > DOWNLOAD_MAX_BYTES:
                    raise ValueError(f"{url}: {total} bytes is over the {DOWNLOAD_MAX_BYTES}-byte cap")
                chunks, size, shown = [], 0, 0
                # read1 returns what one read brings, so the pace is checked however slowly bytes arrive.
                while chunk := response.read1(1 << 20):
                    chunks.append(chunk)
                    size += len(chunk)
                    check_pace(url, size, started, timeout, deadline)
                    if size > DOWNLOAD_MAX_BYTES:
                        raise ValueError(f"{url}: more than the {DOWNLOAD_MAX_BYTES}-byte cap")
                    if total > (4 << 20) and size * 10 // total > shown:
                        shown = size * 10 // total
                        say(f"downloading {url}: {size >> 20} of {total >> 20} MiB")
                if total and size != total:
                    raise ConnectionError(f"{url}: connection closed after {size} of {total} bytes")
                return b"".join(chunks)
        except TooSlow:
            raise
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or attempt == DOWNLOAD_RETRIES:  # 4xx will not change on retry
                raise ConnectionError(f"{url}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError) as exc:
            if attempt == DOWNLOAD_RETRIES:
                reason = getattr(exc, "reason", exc)
                raise ConnectionError(f"{url}: {reason} (after {attempt} attempts)") from None
        time.sleep(2 ** (attempt - 1))  # 1 s, 2 s: enough for a restarting server, short enough offline
    raise AssertionError("unreachable")


def write_atomic(path, data):
    """Write bytes so that `path` is either absent or complete, never half-written."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide results from the other users of a shared volume
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch_file(name, expected, data_dir, system_dirs, mirrors, timeout, say=print, deadline=600.0):
    """Make a verified copy of one IDX file exist in data_dir, from the first source that has one."""
    data_dir = Path(data_dir)
    failures = []
    present = local_copy(data_dir, name)
    if present:
        try:
            check_file(present.read_bytes(), str(present), expected)
            return str(data_dir.resolve())  # another job sharing the data dir fetched it meanwhile
        except ValueError as exc:
            failures.append(str(exc))
            say(f"warning: {exc}; fetching it again")

    def from_dir(directory):
        path = local_copy(directory, name)
        return (path.read_bytes(), data_dir / path.name) if path else None

    def from_mirror(url):
        return download(f"{url.rstrip('/')}/{name}.gz", timeout, say, deadline), data_dir / f"{name}.gz"

    sources = [(str(Path(d).resolve()), functools.partial(from_dir, d)) for d in system_dirs]
    sources += [(url, functools.partial(from_mirror, url)) for url in mirrors]
    for source, get in sources:
        try:
            got = get()
            if got is None:
                continue
            raw, target = got
            check_file(raw, f"{name} from {source}", expected)
        except (ValueError, ConnectionError, OSError) as exc:
            failures.append(str(exc))
            continue
        if present and present != target:
            present.unlink()  # the bad copy would shadow or confuse the good one
        write_atomic(target, raw)
        say(f"{name}: verified copy from {source}")
        return url_of(source, name)
    raise UsageError(
        f"cannot obtain {name}: " + "; ".join(failures or ["no source has it"]) + ". Sources tried: "
        f"{', '.join(map(str, [data_dir, *system_dirs, *mirrors]))}. Provide the data with --data-dir "
        "pointing at the four IDX files, install the dataset-fashion-mnist package, or add a reachable "
        "--data-mirrors URL")


def url_of(source, name):
    """Where a file came from: its URL for a mirror, the directory for a local copy."""
    return f"{source.rstrip('/')}/{name}.gz" if "://" in source else source


def is_verified(data_dir, name, expected):
    present = local_copy(data_dir, name)
    try:
        return present is not None and check_file(present.read_bytes(), name, expected) is None
    except (ValueError, OSError):
        return False


def ensure_data(data_dir, checksums, mirrors, timeout, system_dirs=SYSTEM_DATA_DIRS, say=print, deadline=600.0):
    """Make the four verified IDX files exist in data_dir; no network request when they already do. Returns
    where each came from: {name: the data dir, a system directory, or the mirror URL}."""
    data_dir = Path(data_dir)
    sources = {name: str(data_dir.resolve()) for name in checksums if is_verified(data_dir, name, checksums[name])}
    missing = [name for name in checksums if name not in sources]
    if not missing:
        return sources  # complete: works on a read-only data dir, such as one baked into an image
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = open(data_dir / ".lock", "a+b")  # pylint: disable=consider-using-with
    except OSError as exc:
        raise UsageError(f"--data-dir {data_dir}: cannot use it ({exc.strerror})") from None
    # Two jobs sharing one data dir take turns; the second then finds verified files and does no I/O.
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in missing:
            sources[name] = fetch_file(name, checksums[name], data_dir, system_dirs, mirrors, timeout, say, deadline)
    return sources


def load_split(data_dir, split):
    """(images uint8 [N, H, W], labels uint8 [N]) of the 'train' or 't10k' split."""
    images, labels = (parse_idx(local_copy(data_dir, f"{split}-{kind}").read_bytes(), kind)
                      for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))
    if len(images) != len(labels):
        raise UsageError(f"{data_dir}: {split} has {len(images)} images but {len(labels)} labels")
    return images, labels


def to_model_input(images):
    """The article's image transforms, applied once to a whole uint8 array [N, H, W(, C)]:
    resize to 28x28, rescale by 1/255, HWC -> CHW, float32. Returns float32 [N, C, 28, 28].

    Fashion-MNIST fits in memory many times over, so transforming it once beats a per-sample map each epoch.
    """
    if images.ndim == 3:
        images = images[..., None]
    if images.shape[1:3] != (IMAGE_SIZE, IMAGE_SIZE):
        resize = ms.dataset.vision.Resize((IMAGE_SIZE, IMAGE_SIZE))
        images = np.stack([resize(image) for image in images]).reshape(len(images), IMAGE_SIZE, IMAGE_SIZE, -1)
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) * np.float32(1 / 255)


def one_hot(labels, num_classes=len(CLASS_NAMES)):
    return np.eye(num_classes, dtype=np.float32)[labels]


class ShardBatches:
    """This rank's share of every epoch, as whole batches of already-transformed arrays.

    Each epoch draws one permutation from (seed, epoch), the same on every rank, and rank r takes the r-th
    contiguous block of it, so shards are disjoint and together cover the epoch. Whole batches cost one
    fancy-index each, where a per-sample source with the framework's sharding spent about a third of the
    2-core machine's step time in the pipeline. Counting from `first_epoch` gives a resumed job the same
    data order as an uninterrupted one.
    """

    def __init__(self, images, labels, batch_size, rank, world_size, seed, first_epoch=0):
        self.images, self.labels = images, labels
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.epoch = first_epoch

    def __len__(self):
        return len(self.images) // (self.batch_size * self.world_size)

    def __iter__(self):
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.images))
        self.epoch += 1
        per_rank = len(self) * self.batch_size
        mine = order[self.rank * per_rank:(self.rank + 1) * per_rank]
        for start in range(0, per_rank, self.batch_size):
            batch = mine[start:start + self.batch_size]
            yield self.images[batch], self.labels[batch]


def train_dataset(images, labels, batch_size, rank, world_size, seed, first_epoch=0):
    source = ShardBatches(to_model_input(images), one_hot(labels), batch_size, rank, world_size, seed,
                          first_epoch)
    return ms.dataset.GeneratorDataset(source, column_names=["image", "label"], shuffle=False,
                                       python_multiprocessing=False)


def eval_dataset(images, labels, batch_size, rank, world_size):
    """Every world_size-th test sample from `rank` on, in whole batches. The framework's sampler pads shards
    to equal length by repeating samples, which would count some twice; slicing gives each sample to
    exactly one rank."""
    shard = slice(rank, None, world_size)
    images, labels = to_model_input(images[shard]), one_hot(labels[shard])
    batches = [(images[i:i + batch_size], labels[i:i + batch_size]) for i in range(0, len(images), batch_size)]
    return ms.dataset.GeneratorDataset(batches, column_names=["image", "label"], shuffle=False,
                                       python_multiprocessing=False)


def save_sample_grid(images, labels, path, seed, count=10):
    """PNG of `count` random training images with their class names."""
    plt = pyplot()
    picks = np.random.default_rng(seed).choice(len(images), size=count, replace=False)
    cols = 5
    fig, axes = plt.subplots(math.ceil(count / cols), cols, figsize=(cols * 1.6, 1.9 * math.ceil(count / cols)))
    for ax, index in zip(axes.flat, picks):
        ax.imshow(images[index], cmap="gray", vmin=0, vmax=255)
        ax.set_title(CLASS_NAMES[labels[index]], fontsize=9)
    for ax in axes.flat:
        ax.axis("off")
    fig.tight_layout(pad=0.3)
    write_figure(fig, path)


def pyplot():
    """matplotlib on its file-only backend, imported late: only rank 0 draws, and only after init()."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    return plt


def write_figure(fig, path):
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    pyplot().close(fig)
    write_atomic(path, buffer.getvalue())


def save_training_curves(loss_points, epoch_history, path):
    """PNG of the training loss (per log interval) and the validation loss and accuracy (per epoch)."""
    fig, (loss_ax, acc_ax) = pyplot().subplots(1, 2, figsize=(9, 3.4))
    epochs = [e["epoch"] for e in epoch_history]
    if loss_points:
        loss_ax.plot(*zip(*loss_points), label="training (mean over ranks)", color="tab:blue", alpha=0.8)
    loss_ax.plot(epochs, [e["val_loss"] for e in epoch_history], "o-", label="test set", color="tab:orange")
    loss_ax.set(xlabel="epoch", ylabel="cross-entropy loss", title="Loss")
    loss_ax.legend()
    acc_ax.plot(epochs, [e["val_accuracy"] for e in epoch_history], "o-", color="tab:green")
    acc_ax.set(xlabel="epoch", ylabel="accuracy", title="Test-set accuracy")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    write_figure(fig, path)


def save_confusion_matrix(matrix, path):
    """PNG of the test-set confusion matrix with counts, rows the true class."""
    fig, ax = pyplot().subplots(figsize=(7, 6))
    ax.imshow(matrix, cmap="Blues")
    for (row, col), count in np.ndenumerate(matrix):
        ax.text(col, row, str(count), ha="center", va="center", fontsize=7,
                color="white" if count > matrix.max() / 2 else "black")
    ticks = range(len(CLASS_NAMES))
    ax.set_xticks(ticks, CLASS_NAMES, rotation=45, ha="right")
    ax.set_yticks(ticks, CLASS_NAMES)
    accuracy = np.trace(matrix) / max(matrix.sum(), 1)
    ax.set(xlabel="predicted", ylabel="true", title=f"Test set: {matrix.sum()} images, accuracy {accuracy:.4f}")
    fig.tight_layout()
    write_figure(fig, path)


# --- model


class LeNet(nn.Cell):
    """The article's LeNet: two 5x5 `valid` convolutions (6 and 16 channels) each with ReLU and 2x2 max-pooling,
    28 -> 24 -> 12 -> 8 -> 4, then dense 256-120-84-10; 44,426 parameters."""

    def __init__(self, num_classes=len(CLASS_NAMES)):
        super().__init__()
        self.features = nn.SequentialCell(
            nn.Conv2d(1, 6, 5, pad_mode="valid", has_bias=True), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(6, 16, 5, pad_mode="valid", has_bias=True), nn.ReLU(), nn.MaxPool2d(2, 2))
        self.classifier = nn.SequentialCell(
            nn.Flatten(), nn.Dense(16 * 4 * 4, 120), nn.ReLU(), nn.Dense(120, 84), nn.ReLU(),
            nn.Dense(84, num_classes))

    def construct(self, x):
        return self.classifier(self.features(x))


def make_optimizer(cfg, params, loss_scale_mode):
    # A fixed scale without overflow checks leaves the gradients scaled: the optimizer divides them back.
    scale = fixed_loss_scale(loss_scale_mode) or 1.0
    if cfg.optimizer == "adam":
        return nn.Adam(params, learning_rate=cfg.lr, weight_decay=cfg.weight_decay, loss_scale=scale)
    momentum = cfg.momentum if cfg.optimizer == "momentum" else 0.0
    return nn.SGD(params, learning_rate=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay, loss_scale=scale)


def weights_fingerprint(net):
    """SHA-256 of every parameter's bytes in a fixed order, as 8 int32 for a collective."""
    digest = hashlib.sha256()
    for param in sorted(net.trainable_params(), key=lambda p: p.name):
        digest.update(param.name.encode())
        digest.update(param.asnumpy().tobytes())
    return np.frombuffer(digest.digest(), dtype=np.int32)


def save_checkpoint(cell, path, extra=None):
    """Write a CRC-checked checkpoint so that `path` is complete or absent (MindSpore writes in place)."""
    tmp = Path(path).with_name(f".{Path(path).stem}.part.ckpt")  # save_checkpoint insists on .ckpt
    ms.save_checkpoint(cell, str(tmp), append_dict=extra, crc_check=True)
    os.replace(tmp, path)


# --- serving: the MLflow model


class ServedModel:
    """The exported model as `mlflow models serve` runs it. In: a batch of 28x28 grayscale images as 0-255
    pixel values, oriented as in the IDX files ([N, 28, 28]). Out: per image the class index, the class name
    and the ten probabilities. The preprocessing is the training's own (to_model_input)."""

    def __init__(self, mindir):
        self.net = nn.GraphCell(ms.load(str(mindir)))

    def predict(self, model_input, params=None):  # pylint: disable=unused-argument
        images = np.asarray(model_input, dtype=np.uint8)
        return prediction_frame(self.net(Tensor(to_model_input(images))).asnumpy())


def prediction_frame(logits):
    import pandas as pd  # pylint: disable=import-outside-toplevel
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    probabilities = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    classes = probabilities.argmax(axis=1)
    return pd.DataFrame({"class_index": classes.astype(np.int64), "class_name": [CLASS_NAMES[c] for c in classes],
                         "probabilities": [row.tolist() for row in probabilities]})


def _load_pyfunc(path):
    """MLflow's entry point for this file as a pyfunc loader_module: the model from its MindIR at `path`."""
    cap_onednn_isa()  # in the serving process as in training, before its first CPU kernel
    return ServedModel(path)


def export_mindir(net, path):
    """The model for inference as MindIR, written atomically like everything else."""
    tmp = Path(path).with_name(f".{Path(path).stem}.part")
    any_batch = Tensor(shape=[None, 1, IMAGE_SIZE, IMAGE_SIZE], dtype=ms.float32)
    ms.export(net, any_batch, file_name=str(tmp), file_format="MINDIR")
    os.replace(f"{tmp}.mindir", path)


def checkpoint_path(directory, epoch):
    return Path(directory) / f"epoch-{epoch:04d}.ckpt"


def trajectory(cfg, resolved, train_network):
    """What decides the course of a training: every setting not free to change on resume, what the job
    resolved (amp level, loss scaling, world size, the data's checksums), and the parameters' shapes, which
    cover the model and the optimizer state."""
    shapes = {p.name: list(p.shape) for p in train_network.get_parameters()}
    return {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in FREE_ON_RESUME}, **resolved,
            "parameter_shapes": shapes}


def resume_conflicts(meta, current):
    """What differs between a checkpoint's training and this job's, one 'name: was X, now Y' per item."""
    if meta.get("format") != CHECKPOINT_FORMAT:
        return [f"checkpoint format: was {meta.get('format', 1)} (written by job {meta.get('job_version', '1.0.0')}), "
                f"now {CHECKPOINT_FORMAT} (job {JOB_VERSION})"]
    saved = meta["trajectory"]
    conflicts = []
    for name in sorted(set(saved) | set(current)):
        if saved.get(name) != current.get(name):
            was, now = saved.get(name), current.get(name)
            if name == "parameter_shapes":  # say which, not the whole table
                differing = sorted(k for k in set(was or {}) | set(now or {}) if (was or {}).get(k) != (now or {}).get(k))
                was, now = "another model or optimizer", f"this one (differing: {', '.join(differing[:3])})"
            conflicts.append(f"{name}: was {was}, now {now}")
    return conflicts


def load_latest_checkpoint(directory, train_network, current):
    """Load the newest checkpoint that reads back whole into `train_network` (weights and optimizer state);
    a corrupt or partial one is skipped with a warning. Returns its metadata, or None. A checkpoint of another
    training (other settings, model, world size or job version) raises UsageError naming every difference:
    continuing it with this job's settings would produce a model that no run describes."""
    for path in sorted(Path(directory).glob("epoch-*.ckpt"), reverse=True):
        try:
            params = ms.load_checkpoint(str(path), crc_check=True)
            meta = json.loads(params.pop("meta"))
        except Exception as exc:  # pylint: disable=broad-except
            log.warning("skipping checkpoint %s: %s", path, str(exc).splitlines()[0])
            continue
        conflicts = resume_conflicts(meta, current)
        if conflicts:
            raise UsageError(f"cannot resume from {path}, a checkpoint of another training: {'; '.join(conflicts)}. "
                             "Start fresh with --resume never, or give another --output-dir")
        missing, _ = ms.load_param_into_net(train_network, params)
        if missing:  # same shapes recorded, yet not these parameters: a damaged checkpoint
            raise UsageError(f"cannot resume from {path}: it lacks {len(missing)} parameters, such as {missing[0]}; "
                             "start fresh with --resume never")
        return {**meta, "path": str(path)}
    return None


class CheckpointSaver(Callback):
    """Rank 0 writes one checkpoint per epoch (weights, optimizer state, epoch and the figures so far) and
    keeps the newest `keep`; only one process ever writes a checkpoint file."""

    def __init__(self, directory, keep, monitor, tracker, current):
        super().__init__()
        self.directory, self.keep, self.monitor, self.tracker = Path(directory), keep, monitor, tracker
        self.current = current  # the trajectory, checked on resume

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        # run_id waits only while the run is being created, so a resumed job can continue the same run.
        meta = {"format": CHECKPOINT_FORMAT, "job_version": JOB_VERSION, "trajectory": self.current,
                "epoch": cb.cur_epoch_num, "mlflow_run_id": self.tracker.run_id,
                "history": self.monitor.epoch_history, "loss_points": self.monitor.loss_points}
        self.directory.mkdir(parents=True, exist_ok=True)
        save_checkpoint(cb.train_network, checkpoint_path(self.directory, cb.cur_epoch_num),
                        extra={"meta": json.dumps(meta)})
        for old in sorted(self.directory.glob("epoch-*.ckpt"))[:-self.keep]:
            old.unlink()


# --- metrics and tracking


def correct_predictions(logits, one_hot_labels):
    return (logits.argmax(axis=1) == one_hot_labels.argmax(axis=1)).astype(np.float64)


def cross_entropy(logits, one_hot_labels):
    """Per-sample softmax cross-entropy, computed stably in float64."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -(one_hot_labels * log_probs).sum(axis=1)


class GlobalMean(Metric):
    """Mean of a per-sample quantity over the whole test set: each rank sums its shard, eval() gathers the
    sums, so the figure is the job's, not rank 0's shard."""

    def __init__(self, per_sample, collective):
        super().__init__()
        self._per_sample, self._collective = per_sample, collective
        self.clear()

    def clear(self):
        self._sum, self._count = 0.0, 0

    def update(self, *inputs):
        values = self._per_sample(inputs[0].asnumpy(), inputs[1].asnumpy())
        self._sum += float(values.sum())
        self._count += len(values)

    def eval(self):
        total, count = self._collective.all_gather(np.array([self._sum, self._count])).sum(axis=0)
        return total / count


class GlobalConfusion(Metric):
    """Confusion matrix (rows: true class, columns: predicted) over the whole test set, summed across ranks."""

    def __init__(self, collective, num_classes=len(CLASS_NAMES)):
        super().__init__()
        self._collective, self._num_classes = collective, num_classes
        self.clear()

    def clear(self):
        self._counts = np.zeros((self._num_classes, self._num_classes), dtype=np.int64)

    def update(self, *inputs):
        predicted, actual = inputs[0].asnumpy().argmax(axis=1), inputs[1].asnumpy().argmax(axis=1)
        np.add.at(self._counts, (actual, predicted), 1)

    def eval(self):
        return self._collective.all_gather(self._counts).sum(axis=0)


def apply_mlflow_defaults():
    for name, value in MLFLOW_DEFAULTS.items():
        os.environ.setdefault(name, value)  # a user's setting wins


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
    """Log the exported MindIR as the run's MLflow model `model` (pyfunc, loaded by _load_pyfunc below), with
    its signature, an input example of real test images and the job's pinned requirements; register it when
    asked, tagged with the test accuracy. Runs on the tracker's thread, inside the run."""
    with warnings.catch_warnings():  # that integer columns cannot hold missing values: class indices never miss
        warnings.simplefilter("ignore", UserWarning)
        signature = mlflow.models.infer_signature(payload["example"], payload["predictions"])
    info = mlflow.pyfunc.log_model(
        name="model", loader_module=Path(__file__).stem, data_path=payload["mindir"],
        code_paths=[str(Path(__file__).resolve())], signature=signature, input_example=payload["example"],
        pip_requirements=str(Path(__file__).resolve().parent / "requirements.txt"),
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


class MlflowTracker(NullTracker):
    """The job's one MLflow run, driven from rank 0 by a background thread.

    Training never waits for tracking: connecting, creating the run and every request happen on the thread,
    metrics queued between two requests go out as one batch, and the first failure (server down at start
    or gone mid-run) turns tracking off with one warning instead of failing or stalling the job. finish()
    waits a bounded time and says what was not logged. The run is MLflow's own kind: started with
    mlflow.start_run, whose context providers add the user, the source and its git commit; it holds the
    datasets, this node's system metrics and, at the end, the model as an MLflow model.
    """

    def __init__(self, experiment, run_name, params, tags, resume_run_id=None, datasets=(), node="node0",
                 finish_timeout=MLFLOW_FINISH_TIMEOUT_S):
        apply_mlflow_defaults()
        self._finish_timeout = finish_timeout
        self._queue = queue.SimpleQueue()
        self._not_logged = collections.Counter()
        self._error = None
        self._connected = threading.Event()  # set once the run exists or starting it failed
        self._run_id = None
        self._thread = threading.Thread(target=self._work, name="mlflow-tracker", daemon=True,
                                        args=(experiment, run_name, params, tags, resume_run_id, datasets, node))
        self._thread.start()

    @property
    def run_id(self):
        """The run's id once it exists; None if starting it failed or takes longer than the finish bound."""
        return self.run_id_within(self._finish_timeout)

    def run_id_within(self, timeout):
        self._connected.wait(timeout)
        return self._run_id

    def log_metrics(self, metrics, step):
        self._queue.put(("metrics", (dict(metrics), step, int(time.time() * 1000))))

    def log_artifact(self, path):
        self._queue.put(("artifact", str(path)))

    def log_model(self, mindir, example, predictions, register_as, test_accuracy):
        self._queue.put(("model", {"mindir": str(mindir), "example": example, "predictions": predictions,
                                   "register_as": register_as, "test_accuracy": test_accuracy}))

    def finish(self, status, timeout=None):
        timeout = timeout or self._finish_timeout
        self._queue.put(("end", status))
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._fail(TimeoutError(f"no answer within {timeout:.0f} s"), "finishing the run")
            while not self._queue.empty():
                kind, payload = self._queue.get()
                self._count_not_logged(kind, [payload])
        if self._not_logged:
            what = ", ".join(f"{n} {kind}" for kind, n in sorted(self._not_logged.items()))
            log.warning("MLflow: not logged: %s (tracking failed: %s)", what, self._error)

    def _work(self, experiment, run_name, params, tags, resume_run_id, datasets, node):
        import mlflow  # pylint: disable=import-outside-toplevel
        from mlflow.entities import Metric as MlflowMetric  # pylint: disable=import-outside-toplevel
        from mlflow.system_metrics.system_metrics_monitor import (  # pylint: disable=import-outside-toplevel
            SystemMetricsMonitor)
        system_metrics = None
        try:
            client = mlflow.MlflowClient()
            if resume_run_id and not run_exists(client, resume_run_id):
                log.warning("MLflow: the checkpoint's run %s is not at %s (another tracking store); continuing "
                            "in a new run there, tagged resumed_from_run; the earlier epochs stay in the old one",
                            resume_run_id, mlflow.get_tracking_uri())
                tags, resume_run_id = {**tags, "resumed_from_run": resume_run_id}, None
            if resume_run_id:  # a resumed job continues its run; parameters and datasets are already there
                run = mlflow.start_run(run_id=resume_run_id, log_system_metrics=False)
                client.set_tag(resume_run_id, "resumed", "true")
            else:
                run = mlflow.start_run(experiment_id=experiment_id(client, experiment), run_name=run_name or None,
                                       tags=tags, log_system_metrics=False)
                client.log_batch(run.info.run_id, params=[mlflow.entities.Param(k, str(v)) for k, v in params.items()])
                for context, (images, labels, name, digest, source) in datasets:
                    with warnings.catch_warnings():  # that a local path could be one of two kinds of local source
                        warnings.simplefilter("ignore", UserWarning)
                        dataset = mlflow.data.from_numpy(images, targets=labels, source=source, name=name, digest=digest)
                    mlflow.log_input(dataset, context=context)
            self._run_id = run.info.run_id
            system_metrics = SystemMetricsMonitor(self._run_id, node_id=node)
            system_metrics.start()
            log.info("MLflow: run %s in experiment '%s' at %s", self._run_id, experiment,
                     run_page(mlflow.get_tracking_uri(), run.info.experiment_id, self._run_id))
        except Exception as exc:  # pylint: disable=broad-except
            self._fail(exc, f"starting a run at {mlflow.get_tracking_uri()}")
        self._connected.set()
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get())
            # Consecutive metric items become one request; order with artifacts and the end is kept.
            for kind, group in itertools.groupby(items, key=lambda item: item[0]):
                payloads = [payload for _, payload in group]
                if kind == "end":
                    if system_metrics:
                        system_metrics.finish()
                    if self._error is None:
                        self._attempt(lambda: mlflow.end_run(payloads[0]), "ending the run", "run end")
                    return
                if self._error is not None:
                    self._count_not_logged(kind, payloads)
                elif kind == "artifact":
                    for path in payloads:
                        self._attempt(lambda p=path: client.log_artifact(self._run_id, p), f"logging {path}",
                                      "artifacts")
                elif kind == "model":
                    self._attempt(lambda: log_served_model(mlflow, client, payloads[0]), "logging the model", "model")
                else:
                    metrics = [MlflowMetric(k, float(v), ts, step)
                               for values, step, ts in payloads for k, v in values.items()]
                    self._attempt(lambda m=metrics: client.log_batch(self._run_id, metrics=m), "logging metrics",
                                  "metric values", count=len(metrics))

    def _count_not_logged(self, kind, payloads):
        if kind == "metrics":
            self._not_logged["metric values"] += sum(len(values) for values, _, _ in payloads)
        elif kind == "artifact":
            self._not_logged["artifacts"] += len(payloads)
        elif kind == "model":
            self._not_logged["model"] += 1

    def _attempt(self, action, what, kind, count=1):
        try:
            action()
        except Exception as exc:  # pylint: disable=broad-except
            self._not_logged[kind] += count
            self._fail(exc, what)

    def _fail(self, exc, what):
        if self._error is None:
            self._error = f"{what}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            log.warning("MLflow: tracking is off for the rest of the job after a failure %s; training goes on",
                        self._error)

class TrainingMonitor(Callback):
    """Measures the job's figures on every rank (the gathers are collectives), prints them on rank 0 and
    hands them to the tracker: training loss averaged across ranks, per-rank loss, samples/s, and the
    per-epoch validation loss and accuracy over the full test set."""

    def __init__(self, collective, tracker, epochs, global_batch, log_interval, started, resumed=None,
                 stop=None):
        super().__init__()
        self.collective, self.tracker = collective, tracker
        self.stop = stop or StopRequest()
        self.epochs, self.global_batch, self.log_interval = epochs, global_batch, log_interval
        self.started = started
        self.first_step_s = None
        # Figures of the epochs before a resume come from the checkpoint, so the record stays whole.
        self.epoch_history = list(resumed["history"]) if resumed else []
        # (epoch as a fraction, cross-rank mean loss) for the training-curves plot
        self.loss_points = [tuple(p) for p in resumed["loss_points"]] if resumed else []
        self.confusion = None
        self._loss_sum, self._loss_steps = None, 0
        # Under dynamic loss scaling: steps skipped for overflowed gradients, and the current scale.
        self._overflows, self._loss_scale, self.skipped_steps = None, None, 0
        self._train_s = None  # set when validation starts, so training time excludes it

    def on_train_epoch_begin(self, run_context):
        self._epoch_start = self._interval_start = time.perf_counter()
        self._epoch_steps = self._interval_steps = 0

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        outputs = cb.net_outputs if isinstance(cb.net_outputs, (tuple, list)) else (cb.net_outputs,)
        # Summing on the device keeps the host from waiting on each step; it is read once per interval.
        self._loss_sum = outputs[0] if self._loss_sum is None else self._loss_sum + outputs[0]
        if len(outputs) == 3:  # dynamic loss scaling's cell returns (loss, overflowed, scale)
            overflowed = ops.cast(outputs[1], ms.int32)
            self._overflows = overflowed if self._overflows is None else self._overflows + overflowed
            self._loss_scale = outputs[2]
        self._loss_steps += 1
        self._epoch_steps += 1
        self._interval_steps += 1
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.started
            if self.collective.is_main:
                log.info("first step done %.1f s after start", self.first_step_s)
        step = (cb.cur_epoch_num - 1) * cb.batch_num + self._epoch_steps  # counts on across a resume
        if step % self.log_interval == 0:
            self._report_interval(cb, step)

    def _report_interval(self, cb, step):
        # One gather carries each rank's loss and whether it was asked to stop, so all ranks decide alike.
        gathered = self.collective.all_gather(
            np.array([float(self._loss_sum.asnumpy()) / self._loss_steps, self.stop.signum], dtype=np.float64))
        per_rank, stop_signals = gathered[:, 0], gathered[:, 1]
        self._loss_sum, self._loss_steps = None, 0
        if not np.isfinite(per_rank).all():
            raise Diverged(f"training loss {per_rank.mean()} at step {step} (epoch {cb.cur_epoch_num})")
        if stop_signals.any():
            raise Terminated(int(stop_signals.max()), step)
        now = time.perf_counter()
        rate = self._interval_steps * self.global_batch / (now - self._interval_start)
        self._interval_start, self._interval_steps = now, 0
        if self.collective.is_main:
            log.info("epoch %d/%d | step %d/%d | loss %.4f | %s samples/s", cb.cur_epoch_num, self.epochs,
                     self._epoch_steps, cb.batch_num, per_rank.mean(), f"{rate:,.0f}")
            metrics = {"train_loss": float(per_rank.mean()), "train_samples_per_s": rate}
            metrics.update({f"train_loss_rank{r}": float(v) for r, v in enumerate(per_rank)})
            if self._loss_scale is not None:
                self.skipped_steps += int(self._overflows.asnumpy())
                metrics.update({"loss_scale": float(self._loss_scale.asnumpy()), "skipped_steps": self.skipped_steps})
                self._overflows = None
            self.tracker.log_metrics(metrics, step=step)
            self.loss_points.append((step / cb.batch_num, float(per_rank.mean())))

    def on_eval_begin(self, run_context):
        self._train_s = time.perf_counter() - self._epoch_start
        self._eval_start = time.perf_counter()

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        if self._train_s is None:  # no validation this epoch
            self._train_s = time.perf_counter() - self._epoch_start
        eval_s = time.perf_counter() - self._eval_start if "metrics" in cb else 0.0
        figures = {"epoch": cb.cur_epoch_num, "train_s": self._train_s, "eval_s": eval_s,
                   "train_samples_per_s": self._epoch_steps * self.global_batch / self._train_s}
        metrics = cb.get("metrics", {})
        figures.update({f"val_{k}": float(v) for k, v in metrics.items() if np.ndim(v) == 0})
        self.confusion = metrics.get("confusion", self.confusion)
        self._train_s = None
        # The same figure on every rank; checked before this epoch's checkpoint is written.
        if not math.isfinite(figures.get("val_loss", 0.0)):
            raise Diverged(f"validation loss {figures['val_loss']} after epoch {cb.cur_epoch_num} "
                           f"(step {cb.cur_epoch_num * cb.batch_num})")
        self.epoch_history.append(figures)
        if self.collective.is_main:
            log.info("epoch %d/%d done | train %.1f s, %s samples/s | eval %.1f s | val_loss %.4f | "
                     "val_accuracy %.4f", cb.cur_epoch_num, self.epochs, figures["train_s"],
                     f"{figures['train_samples_per_s']:,.0f}", eval_s, figures.get("val_loss", float("nan")),
                     figures.get("val_accuracy", float("nan")))
            # Per-epoch figures use the epoch as MLflow's step, so their charts read in epochs.
            self.tracker.log_metrics({f"epoch_{k}" if k in ("train_s", "eval_s", "train_samples_per_s") else k: v
                                      for k, v in figures.items() if k != "epoch"}, step=cb.cur_epoch_num)


def start_tracking(cfg, resolved, resume_run_id, datasets, node):
    """The job's MLflow run: every setting and what the job resolved them to (device, world size, amp level,
    loss scaling, ...), as parameters; tags to filter runs by."""
    params = {**dataclasses.asdict(cfg), **resolved, "global_batch_size": cfg.batch_size * resolved["world_size"],
              "mindspore_version": ms.__version__, "job_version": JOB_VERSION}
    tags = {"device": resolved["device"], "world_size": str(resolved["world_size"]), "job_version": JOB_VERSION}
    if os.environ.get("GIT_COMMIT"):  # an image has no .git for MLflow's git context to read; its build says
        tags["mlflow.source.git.commit"] = os.environ["GIT_COMMIT"]
    return MlflowTracker(cfg.experiment, cfg.run_name, params, tags, resume_run_id=resume_run_id, datasets=datasets,
                         node=node)


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


def lock_output_dir(output_dir):
    """Make `output_dir` this job's: an exclusive flock on output_dir/.lock, whose text names the holder.

    flock, because the kernel releases it when the holder dies however it dies (kill -9, OOM), so a restart
    is never blocked by a stale lock; NFS clients map it onto NFS byte-range locks, which the server drops
    when the client's lease lapses. Returns the open lock file, to be kept for the job's lifetime.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(output_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    lock = os.fdopen(fd, "r+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock.read().strip() or "another job"
        lock.close()
        raise UsageError(f"--output-dir {output_dir} is in use by {holder}; wait for that job to end, or give "
                         "another --output-dir") from None
    lock.truncate(0)
    lock.write(f"the job on host {socket.gethostname()}, pid {os.getpid()}, started "
               f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    lock.flush()
    return lock


def write_json(path, data):
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


def configure_logging(rank):
    logging.basicConfig(level=logging.INFO, force=True, datefmt="%H:%M:%S",
                        format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")


def predict(model_path, metrics, test_ds, collective):
    """Evaluate a saved model on the test set: a checkpoint of LeNet's weights or an exported MindIR."""
    path = Path(model_path)
    if not path.is_file():
        log.error("--predict %s: no such file; give a model.ckpt or model.mindir from a finished job", path)
        return EXIT_USAGE
    try:
        if path.suffix == ".mindir":
            net = nn.GraphCell(ms.load(str(path)))
        else:
            net = LeNet()
            missing, _ = ms.load_param_into_net(net, ms.load_checkpoint(str(path), crc_check=True))
            if missing:
                raise ValueError(f"it has no {', '.join(missing)}")
    except (ValueError, RuntimeError) as exc:
        log.error("--predict %s: cannot load it (%s)", path, str(exc).splitlines()[0])
        return EXIT_USAGE
    for images, labels in test_ds.create_tuple_iterator(num_epochs=1):
        logits = net(images)
        for metric in metrics.values():
            metric.update(logits, labels)
    results = {name: metric.eval() for name, metric in metrics.items()}
    if collective.is_main:
        print(f"{path}: test accuracy {results['accuracy']:.4f}, test loss {results['loss']:.4f} "
              f"on {int(results['confusion'].sum())} images")
    return 0


# --- main


def main(argv=None):
    started = time.perf_counter()
    try:
        cfg = parse_config(argv)
        checksums = load_checksums(cfg.checksums_file)
        device = resolve_device(cfg.device)
        amp_level = resolve_amp(cfg.amp, device)
        loss_scale = resolve_loss_scale(cfg.loss_scale, amp_level, device)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    isa_cap = cap_onednn_isa() if device == "CPU" else None
    cpu = cpu_description()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(device)

    rank, local_rank, world_size = init_distributed()
    collective = Collective(rank, local_rank, world_size)
    configure_logging(rank)
    local_workers = int(os.environ.get("LOCAL_WORKERS") or world_size)
    cores = worker_cores(usable_cores(), local_rank, local_workers)
    if device == "CPU" and cfg.cpu_bind == "on":
        bind_to_cores(cores)  # before MindSpore starts its thread pools, which inherit the binding
    threads = cfg.threads or len(cores)
    if device == "CPU":
        ms.device_context.cpu.op_tuning.threads_num(threads)
    ms.dataset.config.set_num_parallel_workers(threads)
    ms.set_seed(cfg.seed)  # identical initial weights on every replica: MindSpore does not broadcast them
    # Every rank says who it is: run.sh finds a failed worker's log by the pid msrun reports.
    log.info("rank %d of %d (pid %d), device %s, amp %s, loss scale %s, %d threads on cores %s, oneDNN ISA cap %s, "
             "settings %s", rank, world_size, os.getpid(), device, amp_level, loss_scale, threads,
             sorted(os.sched_getaffinity(0)), isa_cap,
             json.dumps(dataclasses.asdict(cfg), default=str))

    try:
        # Held until this process ends, however it ends: the kernel drops the lock with the last descriptor.
        output_lock = lock_output_dir(cfg.output_dir) if collective.is_main else None  # noqa: F841
        sources = {}  # where each file came from, for the MLflow datasets
        if collective.is_local_main:  # one per node: nodes need not share a file system
            sources = ensure_data(cfg.data_dir, checksums, cfg.mirrors, cfg.download_timeout, say=log.info,
                                  deadline=cfg.download_deadline)
        collective.barrier()
        train_images, train_labels = load_split(cfg.data_dir, "train")
        test_images, test_labels = load_split(cfg.data_dir, "t10k")
    except (UsageError, OSError, ValueError) as exc:
        log.error("%s", exc)
        return EXIT_USAGE

    test_ds = eval_dataset(test_images, test_labels, cfg.batch_size, rank, world_size)
    metrics = {"loss": GlobalMean(cross_entropy, collective),
               "accuracy": GlobalMean(correct_predictions, collective), "confusion": GlobalConfusion(collective)}
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="mean")
    if cfg.predict:
        return predict(cfg.predict, metrics, test_ds, collective)

    net = LeNet()
    model = Model(net, loss_fn, make_optimizer(cfg, net.trainable_params(), loss_scale), amp_level=amp_level, metrics=metrics,
                  loss_scale_manager=loss_scale_manager(loss_scale))
    checkpoints = cfg.output_dir / "checkpoints"
    current = trajectory(cfg, {"amp_level": amp_level, "loss_scaling": loss_scale, "world_size": world_size,
                               "data_sha256": checksums}, model.train_network)
    try:
        resumed = load_latest_checkpoint(checkpoints, model.train_network, current) if cfg.resume == "auto" else None
    except UsageError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    start_epoch = resumed["epoch"] if resumed else 0
    agreed = collective.all_gather(np.int64(start_epoch))
    if (agreed != start_epoch).any():
        log.error("ranks found different checkpoints to resume from (epochs %s); is %s shared by all nodes?",
                  agreed.tolist(), checkpoints)
        return EXIT_USAGE
    if resumed:
        log.info("resuming from %s: %d of %d epochs done", resumed["path"], start_epoch, cfg.epochs)

    tracker = NullTracker()
    if collective.is_main:
        save_sample_grid(train_images, train_labels, cfg.output_dir / "samples.png", cfg.seed)
        if cfg.tracking == "on":
            tracker = start_tracking(cfg, {"device": device, "world_size": world_size, "amp_level": amp_level,
                                           "loss_scaling": loss_scale, "onednn_isa_cap": isa_cap,
                                           "cpu_model": cpu["model"]},
                                     resumed and resumed["mlflow_run_id"],
                                     dataset_inputs(((train_images, train_labels), (test_images, test_labels)),
                                                    checksums, sources), node_name())
            tracker.log_artifact(cfg.output_dir / "samples.png")
    node_monitor = watch_node(collective, tracker, world_size, local_workers) if cfg.tracking == "on" else None

    train_ds = train_dataset(train_images, train_labels, cfg.batch_size, rank, world_size, cfg.seed, start_epoch)
    stop = StopRequest()
    monitor = TrainingMonitor(collective, tracker, cfg.epochs, cfg.batch_size * world_size,
                              cfg.log_interval, started, resumed, stop)
    callbacks = [monitor]
    if collective.is_main:
        callbacks.append(CheckpointSaver(checkpoints, cfg.keep_checkpoints, monitor, tracker, current))
    fit_start = time.perf_counter()
    try:
        with stop:
            model.fit(cfg.epochs, train_ds, test_ds, valid_frequency=1, callbacks=callbacks,
                      dataset_sink_mode=False, initial_epoch=min(start_epoch, cfg.epochs))
    except (Diverged, Terminated) as exc:
        if isinstance(exc, Diverged) and collective.is_main:
            log.error("training diverged: %s. Start again with a lower --lr (now %g) and --resume never; no "
                      "final model was written, the checkpoints of the good epochs stay in %s", exc, cfg.lr,
                      checkpoints)
        elif collective.is_main:
            log.warning("%s; the next start resumes from the newest checkpoint in %s", exc, checkpoints)
        tracker.finish("FAILED" if isinstance(exc, Diverged) else "KILLED", timeout=MLFLOW_STOP_TIMEOUT_S)
        if node_monitor:
            node_monitor.finish()
        collective.barrier()  # msrun kills every worker at the first exit: let rank 0 finish with MLflow first
        return EXIT_DIVERGED if isinstance(exc, Diverged) else 128 + exc.signum
    fit_s = time.perf_counter() - fit_start
    if monitor.confusion is None:  # every epoch was done before this run: evaluate the final model once
        monitor.confusion = model.eval(test_ds, dataset_sink_mode=False)["confusion"]

    fingerprints = collective.all_gather(weights_fingerprint(net))
    replicas_identical = bool((fingerprints == fingerprints[0]).all())
    peak_rss_mb = collective.all_gather(np.float64(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    # What the convolutions really compute in: float16 under O2 and O3 (O1 casts back after each layer).
    features_dtype = str(net.features(Tensor(to_model_input(test_images[:2]))).dtype)
    if not collective.is_main:
        if node_monitor:
            node_monitor.finish()
        return 0 if replicas_identical else 1

    history = monitor.epoch_history[:cfg.epochs]
    train_s = sum(e["train_s"] for e in history)
    summary = {
        "device": device, "world_size": world_size, "amp_level": amp_level, "loss_scaling": loss_scale,
        "features_dtype": features_dtype, "cpu": {**cpu, "onednn_isa_cap": isa_cap,
                                                  "threads_per_worker": threads}, "epochs": cfg.epochs,
        "global_batch_size": cfg.batch_size * world_size,
        "test_accuracy": history[-1]["val_accuracy"], "test_loss": history[-1]["val_loss"],
        "train_samples_per_s": sum(e["train_samples_per_s"] * e["train_s"] for e in history) / train_s,
        "first_step_s": monitor.first_step_s, "fit_s": fit_s, "wall_s": time.perf_counter() - started,
        "replicas_identical": replicas_identical, "mlflow_run_id": tracker.run_id,
        "skipped_steps": monitor.skipped_steps,
        "resumed_from_epoch": start_epoch, "peak_rss_mb_per_rank": peak_rss_mb.round(1).tolist(),
        "epoch_history": history,
    }
    outputs = {"model.ckpt": lambda path: save_checkpoint(net, path),
               "model.mindir": lambda path: export_mindir(net, path),
               "training_curves.png": lambda path: save_training_curves(monitor.loss_points, history, path),
               "confusion_matrix.png": lambda path: save_confusion_matrix(monitor.confusion, path),
               "summary.json": lambda path: write_json(path, summary)}
    for name, write in outputs.items():
        write(cfg.output_dir / name)
        tracker.log_artifact(cfg.output_dir / name)
    example = test_images[:SERVING_EXAMPLE_IMAGES]
    tracker.log_model(cfg.output_dir / "model.mindir", example,
                      prediction_frame(net(Tensor(to_model_input(example))).asnumpy()), cfg.register_model,
                      summary["test_accuracy"])
    tracker.log_metrics({"wall_s": summary["wall_s"], "test_accuracy": summary["test_accuracy"],
                         "test_loss": summary["test_loss"]}, step=cfg.epochs)
    tracker.finish("FINISHED" if replicas_identical else "FAILED")
    log.info("test accuracy %.4f, test loss %.4f, %s samples/s, wall %.1f s -> %s",
             summary["test_accuracy"], summary["test_loss"], f"{summary['train_samples_per_s']:,.0f}",
             summary["wall_s"], cfg.output_dir / "summary.json")
    if not replicas_identical:
        log.error("replicas diverged: weight fingerprints differ across ranks %s", fingerprints.tolist())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
