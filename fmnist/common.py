"""What every stage shares: exit codes, the bad-input error, the start-up clock, logging, files written whole,
the one lock."""

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import socket
import time

JOB_VERSION = "1.0.0"
# Exits that a retry of the same pod cannot mend, which k8s-job.yaml's podFailurePolicy reads.
EXIT_USAGE, EXIT_DIVERGED, EXIT_DISK_FULL = 2, 3, 4  # bad settings or data; diverged; a full volume

log = logging.getLogger("fashion-mnist")


class UsageError(Exception):
    status = EXIT_USAGE  # a setting or the data is wrong; the message says what, and how to fix it


class DiskFull(Exception):
    status = EXIT_DISK_FULL  # no space (or quota) for a file the job writes; nothing half-written was kept

    def __init__(self, path, exc):
        super().__init__(f"no space left on the device of {path} ({exc.strerror}); free some space there or "
                         "give a larger volume, then run the same command again: it resumes from the newest "
                         "checkpoint")


def first_line(exc):
    """An exception in one line: its type and the first line of its message."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def duration(seconds):
    """A time for a person to read: '45 s', '12 min 5 s', '2 h 3 min'."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s" if minutes else f"{secs} s"


class Startup:
    """The phases before the first step, each timed as it ends: lap("join") after joining, and so on."""

    def __init__(self):
        self.started, self.phases = time.perf_counter(), {}

    def lap(self, phase):
        self.phases[phase] = time.perf_counter() - self.started - sum(self.phases.values())


def configure_logging(rank):
    logging.basicConfig(level=logging.INFO, force=True, datefmt="%H:%M:%S",
                        format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")


@contextlib.contextmanager
def atomic_path(path, suffix=""):
    """A temporary name beside `path`, renamed to it when the block succeeds, removed (with the writer's own
    temporaries, MindSpore's .tmp) when it fails. `suffix` is for writers that insist on one."""
    tmp = path.with_name(f".{path.stem}.{secrets.token_hex(4)}.part{suffix}")
    with catch_full_disk(path):
        try:
            yield tmp
            os.replace(tmp, path)
        except BaseException:
            for leftover in tmp.parent.glob(f"{tmp.stem}*"):
                leftover.unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def catch_full_disk(path):
    """A full volume (or quota) met while writing `path` becomes DiskFull, the job's exit 4."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(path, exc) from None
        raise


def write_atomic(path, data, sync=True):
    """Write bytes to `path` whole, flushed to disk before the rename unless `sync` is False."""
    with atomic_path(path) as tmp, open(tmp, "xb") as out:
        out.write(data)
        out.flush()
        if sync:
            os.fsync(out.fileno())


def hold_lock(path, what, wait=False, probe=False):
    """A flock on `path` (shared to `probe`), held by the open file returned, which names the holder; the
    kernel drops it however the holder dies. Taken already: UsageError naming the holder, or a `wait`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held until it is closed)
    except OSError as exc:
        raise UsageError(f"{what}: cannot use it ({exc.strerror}); give one this user can write in") from None
    try:
        fcntl.flock(lock, (fcntl.LOCK_SH if probe else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another job"
        lock.close()
        raise UsageError(f"{what} is in use by {holder}; wait for that job to end, or give another "
                         f"{what.split()[0] if what.startswith('--') else 'directory'}") from None
    if not probe:
        with catch_full_disk(path):
            lock.truncate(0)
            lock.write(f"the job on host {socket.gethostname()}, pid {os.getpid()}, started "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
            lock.flush()
    return lock
