"""A dataset's IDX files in its data directory, verified, from the first source that has them: a copy there,
a system copy (a distribution's package), or a mirror. No MindSpore."""

import dataclasses
import gzip
import hashlib
import math
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from . import common

DOWNLOAD_RETRIES = 3
# Slower than this on average after --download-timeout seconds is a trickle: a proxy that would hold the job
# for days, one byte per read time-out.
DOWNLOAD_MIN_BYTES_PER_S = 16 << 10
# The largest official file is 26 MB gzipped; a wrong URL must not fill the disk.
DOWNLOAD_MAX_BYTES = 64 << 20
PROGRESS_S = 5  # between a download's progress lines
IDX_MAGIC = {1: 0x00000801, 3: 0x00000803}  # of unsigned bytes, by number of dimensions


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where a file may come from after the data dir, how long its download may take, who hears of it."""

    mirrors: tuple = ()
    system_dirs: tuple = ()
    package: str = "the dataset's"
    timeout: float = 30.0  # seconds without progress
    deadline: float = 600.0  # seconds for one file in all
    say: object = print


def content(raw, name="IDX data"):
    """The IDX bytes of a file, gzipped or not."""
    try:
        return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except (OSError, EOFError) as exc:
        raise ValueError(f"{name}: corrupt or truncated gzip ({exc})") from None


def parse_idx(raw, name="IDX data", sha256=None):
    """An IDX file of unsigned bytes (gzipped or not) as an array, its content's SHA-256 checked when given;
    ValueError for anything malformed or different."""
    # The checksum is the content's, so a gzipped copy and a decompressed one verify alike.
    raw = content(raw, name)
    if len(raw) < 8:
        raise ValueError(f"{name}: {len(raw)} bytes is too short for an IDX header")
    magic, ndim = int.from_bytes(raw[:4], "big"), raw[3]
    if IDX_MAGIC.get(ndim) != magic:
        raise ValueError(f"{name}: magic number 0x{magic:08x} is not an IDX file of unsigned bytes "
                         f"(expected 0x{IDX_MAGIC[1]:08x} or 0x{IDX_MAGIC[3]:08x})")
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    if len(raw) != header + math.prod(shape):
        raise ValueError(f"{name}: header says shape {shape} ({header + math.prod(shape)} bytes) "
                         f"but the file has {len(raw)} bytes")
    if sha256 and (actual := hashlib.sha256(raw).hexdigest()) != sha256:
        raise ValueError(f"{name}: SHA-256 of the content is {actual}, expected {sha256}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def local_copy(directory, name):
    """The file for `name` in `directory` (.gz or decompressed), or None."""
    return next((p for p in (Path(directory) / f"{name}.gz", Path(directory) / name) if p.is_file()), None)


def receive(url, response, sources):
    """The body of `response` within the size cap, the minimum rate and the deadline, saying its progress."""
    total = int(response.headers.get("Content-Length") or 0)
    body = bytearray()
    started = shown = time.monotonic()
    # read1 returns what one read brings, so the pace is checked however slowly bytes arrive.
    while chunk := response.read1(1 << 20):
        body += chunk
        size, now = len(body), time.monotonic()
        elapsed, rate = now - started, size / max(now - started, 1e-9)
        if size > DOWNLOAD_MAX_BYTES:
            raise ValueError(f"{url}: more than the {DOWNLOAD_MAX_BYTES}-byte cap")
        if elapsed > sources.deadline:
            raise ValueError(f"{url}: not complete after {elapsed:.0f} s ({size} bytes), over "
                             f"--download-deadline {sources.deadline:g}")
        if elapsed > sources.timeout and rate < DOWNLOAD_MIN_BYTES_PER_S:
            raise ValueError(f"{url}: {rate:,.0f} bytes/s after {elapsed:.0f} s, under the minimum of "
                             f"{DOWNLOAD_MIN_BYTES_PER_S:,} bytes/s")
        if now - shown >= PROGRESS_S:
            shown = now
            left = f", {common.duration((total - size) / rate)} left" if total else ""
            sources.say(f"downloading {url}: {size / 2**20:.1f} of {total / 2**20:.1f} MiB, "
                        f"{rate / 2**20:.2f} MiB/s{left}")
    if total and len(body) != total:
        raise ConnectionError(f"{url}: connection closed after {len(body)} of {total} bytes")
    return bytes(body)


def download(url, sources):
    """The bytes at `url`, with DOWNLOAD_RETRIES attempts at transient failures, a body cut half-way too
    (urllib3's Retry covers only the request). A ValueError (over the cap, a trickle, too late) is final."""
    for attempt in range(1, DOWNLOAD_RETRIES + 1):
        try:
            with urllib.request.urlopen(url, timeout=sources.timeout) as response:
                return receive(url, response, sources)
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or attempt == DOWNLOAD_RETRIES:  # a 4xx will not change
                raise ConnectionError(f"{url}: HTTP {exc.code} {exc.reason}") from None
        except OSError as exc:  # URLError, a connection's error or a time-out
            if attempt == DOWNLOAD_RETRIES:
                reason = getattr(exc, "reason", exc)
                raise ConnectionError(f"{url}: {reason} (after {attempt} attempts)") from None
        time.sleep(2 ** (attempt - 1))  # 1 s, 2 s: enough for a restarting server, short enough offline


def fetch_file(name, expected, data_dir, sources, problem=""):
    """A verified copy of one IDX file in data_dir in place of any bad one (its `problem`), from a source."""
    failures = [problem] if problem else []
    found = [(str(Path(d).resolve()), local_copy(d, name)) for d in sources.system_dirs]
    candidates = [(d, copy) for d, copy in found if copy]
    candidates += [(f"{url.rstrip('/')}/{name}.gz", None) for url in sources.mirrors]
    for source, copy in candidates:
        try:
            raw = content(copy.read_bytes() if copy else download(source, sources), f"{name} from {source}")
            parse_idx(raw, f"{name} from {source}", expected)
        except (ValueError, ConnectionError, OSError) as exc:
            failures.append(str(exc))
            continue
        for bad in (data_dir / name, data_dir / f"{name}.gz"):  # it would shadow the good one
            bad.unlink(missing_ok=True)
        # Kept decompressed: every start reads the files, and would gunzip them again.
        common.write_atomic(data_dir / name, raw)
        sources.say(f"{name}: verified copy from {source}")
        return source
    tried = ", ".join(map(str, [data_dir, *sources.system_dirs, *sources.mirrors]))
    raise common.UsageError(
        f"cannot obtain {name}: {'; '.join(failures or ['no source has it'])}. Sources tried: {tried}. "
        f"Provide the data with --data-dir pointing at the IDX files, install the {sources.package} package, "
        "or add a reachable --data-mirrors URL")


def problem_with_copy(data_dir, name, expected):
    """None when data_dir holds a verified copy of `name`; else what is wrong with it ("" if it has none)."""
    if (present := local_copy(data_dir, name)) is None:
        return ""
    try:
        parse_idx(present.read_bytes(), str(present), expected)
    except (ValueError, OSError) as exc:
        return str(exc)
    return None


def ensure_data(data_dir, checksums, sources):
    """The verified files of `checksums` in data_dir, with no request if they are; {name: its source}."""
    data_dir, here = Path(data_dir), str(Path(data_dir).resolve())
    problems = {name: problem_with_copy(data_dir, name, expected) for name, expected in checksums.items()}
    if all(problem is None for problem in problems.values()):
        return dict.fromkeys(checksums, here)  # no lock: a read-only data dir works, as in an image
    # Two jobs sharing one data dir take turns (the lock makes it); the second finds verified files.
    try:
        with common.hold_lock(data_dir / ".lock", f"--data-dir {data_dir}", wait=True):
            found = dict.fromkeys(checksums, here)
            # A verified copy is hashed once; the others again, under the lock.
            for name, expected in checksums.items():
                if problems[name] is None or (problem := problem_with_copy(data_dir, name, expected)) is None:
                    continue
                if problem:
                    sources.say(f"warning: {problem}; fetching it again")
                found[name] = fetch_file(name, expected, data_dir, sources, problem)
            return found
    except OSError as exc:
        raise common.UsageError(f"--data-dir {data_dir}: cannot use it ({exc.strerror})") from None
