"""The four IDX files in the data directory, verified, from the first source that has them: a copy already there,
a system copy (Debian's dataset-fashion-mnist), or a mirror. No MindSpore."""

import gzip
import hashlib
import math
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from . import common

# SHA-256 of the official release's IDX files, decompressed: re-compressed copies (Debian's) match too.
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
SYSTEM_DATA_DIRS = ("/usr/share/datasets/fashion-mnist",)  # Debian/Ubuntu package dataset-fashion-mnist
DOWNLOAD_RETRIES = 3
# Slower than this on average after --download-timeout seconds is a trickle: a proxy that would hold the job for
# days, one byte per read time-out.
DOWNLOAD_MIN_BYTES_PER_S = 16 << 10
DOWNLOAD_MAX_BYTES = 64 << 20  # the largest official file is 26 MB gzipped; a wrong URL must not fill the disk
PROGRESS_S = 5  # between the progress lines of a download
IDX_MAGIC = {1: 0x00000801, 3: 0x00000803}  # unsigned bytes, by number of dimensions


def content(raw, name="IDX data"):  # the IDX bytes of a file, gzipped or not
    try:
        return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except (OSError, EOFError) as exc:
        raise ValueError(f"{name}: corrupt or truncated gzip ({exc})") from None


def parse_idx(raw, name="IDX data"):
    """An IDX file of unsigned bytes (gzipped or not) as an array; ValueError for anything malformed."""
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
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def load_checksums(path):
    """Expected SHA-256 per IDX file: the pinned official ones, or a sha256sum-style file's."""
    if not path:
        return dict(FASHION_MNIST_SHA256)
    try:
        lines = Path(path).read_text().split("\n")
    except OSError as exc:
        raise common.UsageError(f"--checksums-file {path}: cannot read it ({exc.strerror})") from None
    sums = {name.strip().lstrip("*").removesuffix(".gz"): digest.lower()
            for digest, _, name in (line.strip().partition(" ") for line in lines if line.strip())}
    if missing := sorted(set(FASHION_MNIST_SHA256) - set(sums)):
        raise common.UsageError(f"--checksums-file {path}: no checksum for {', '.join(missing)}; "
                                "write one line '<sha256>  <file name>' per IDX file")
    return sums


def check_file(raw, name, expected_sha256):
    """ValueError unless `raw` is a well-formed IDX file whose content has the expected checksum."""
    raw = content(raw, name)  # once: a gzipped file's checksum is its content's
    parse_idx(raw, name)
    actual = hashlib.sha256(raw).hexdigest()
    if actual != expected_sha256:
        raise ValueError(f"{name}: SHA-256 of the content is {actual}, expected {expected_sha256}")


def local_copy(directory, name):
    """The file for `name` in `directory` (.gz or decompressed), or None."""
    return next((p for p in (Path(directory) / f"{name}.gz", Path(directory) / name) if p.is_file()), None)


def receive(url, response, timeout, deadline, say):
    """The body of `response` within the size cap, the minimum rate and the deadline, saying its progress."""
    total = int(response.headers.get("Content-Length") or 0)
    body, started = bytearray(), time.monotonic()
    shown = started
    # read1 returns what one read brings, so the pace is checked however slowly bytes arrive.
    while chunk := response.read1(1 << 20):
        body += chunk
        size, now = len(body), time.monotonic()
        elapsed, rate = now - started, size / max(now - started, 1e-9)
        if size > DOWNLOAD_MAX_BYTES:
            raise ValueError(f"{url}: more than the {DOWNLOAD_MAX_BYTES}-byte cap")
        if elapsed > deadline:
            raise ValueError(f"{url}: not complete after {elapsed:.0f} s ({size} bytes), over --download-deadline "
                             f"{deadline:g}")
        if elapsed > timeout and rate < DOWNLOAD_MIN_BYTES_PER_S:
            raise ValueError(f"{url}: {rate:,.0f} bytes/s after {elapsed:.0f} s, under the minimum of "
                             f"{DOWNLOAD_MIN_BYTES_PER_S:,} bytes/s")
        if now - shown >= PROGRESS_S:
            shown = now
            left = f", {common.duration((total - size) / rate)} left" if total else ""
            say(f"downloading {url}: {size / 2**20:.1f} of {total / 2**20:.1f} MiB, {rate / 2**20:.2f} MiB/s{left}")
    if total and len(body) != total:
        raise ConnectionError(f"{url}: connection closed after {len(body)} of {total} bytes")
    return bytes(body)


def download(url, timeout, say=print, deadline=600.0):
    """The bytes at `url`: `timeout` per read, `deadline` in all, DOWNLOAD_RETRIES attempts at transient failures
    (urllib3's Retry covers the request, not a body cut half-way: one loop does both). A ValueError (over the cap,
    a trickle, past the deadline) is not retried: another attempt would do the same."""
    for attempt in range(1, DOWNLOAD_RETRIES + 1):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http(s) mirrors only)
                return receive(url, response, timeout, deadline, say)
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or attempt == DOWNLOAD_RETRIES:  # 4xx will not change on retry
                raise ConnectionError(f"{url}: HTTP {exc.code} {exc.reason}") from None
        except OSError as exc:  # URLError, a connection's error or a time-out
            if attempt == DOWNLOAD_RETRIES:
                raise ConnectionError(f"{url}: {getattr(exc, 'reason', exc)} (after {attempt} attempts)") from None
        time.sleep(2 ** (attempt - 1))  # 1 s, 2 s: enough for a restarting server, short enough offline


def fetch_file(name, expected, data_dir, system_dirs, mirrors, timeout, say=print, deadline=600.0, failures=()):
    """A verified copy of one IDX file in data_dir, in place of any bad copy, from the first source that has one."""
    failures = [failure for failure in failures if failure]  # what was wrong with the copy in data_dir
    found = [(str(Path(d).resolve()), local_copy(d, name)) for d in system_dirs]
    sources = [(d, copy) for d, copy in found if copy] + [(f"{url.rstrip('/')}/{name}.gz", None) for url in mirrors]
    for source, copy in sources:
        try:
            raw = copy.read_bytes() if copy else download(source, timeout, say, deadline)
            check_file(raw, f"{name} from {source}", expected)
        except (ValueError, ConnectionError, OSError) as exc:
            failures.append(str(exc))
            continue
        for bad in (data_dir / name, data_dir / f"{name}.gz"):
            bad.unlink(missing_ok=True)  # a bad copy would shadow or confuse the good one
        common.write_atomic(data_dir / (copy.name if copy else f"{name}.gz"), raw)
        say(f"{name}: verified copy from {source}")
        return source
    raise common.UsageError(
        f"cannot obtain {name}: " + "; ".join(failures or ["no source has it"]) + ". Sources tried: "
        f"{', '.join(map(str, [data_dir, *system_dirs, *mirrors]))}. Provide the data with --data-dir "
        "pointing at the four IDX files, install the dataset-fashion-mnist package, or add a reachable "
        "--data-mirrors URL")


def problem_with_copy(data_dir, name, expected):
    """None when data_dir holds a verified copy of `name`; else what is wrong with it ("" when it has none)."""
    present = local_copy(data_dir, name)
    try:
        return "" if present is None else check_file(present.read_bytes(), str(present), expected)
    except (ValueError, OSError) as exc:
        return str(exc)


def ensure_data(data_dir, checksums, mirrors, timeout, system_dirs=SYSTEM_DATA_DIRS, say=print, deadline=600.0):
    """The four verified IDX files in data_dir, with no request when they are there; {name: where it came from}."""
    data_dir, here = Path(data_dir), str(Path(data_dir).resolve())
    problems = {name: problem_with_copy(data_dir, name, expected) for name, expected in checksums.items()}
    if all(problem is None for problem in problems.values()):
        return dict.fromkeys(checksums, here)  # works on a read-only data dir, such as one baked into an image
    try:  # two jobs sharing one data dir take turns (the lock makes it); the second finds verified files
        with common.hold_lock(data_dir / ".lock", f"--data-dir {data_dir}", wait=True):
            sources = {}
            for name, expected in checksums.items():  # a verified copy is hashed once; the others again
                problem = None if problems[name] is None else problem_with_copy(data_dir, name, expected)
                if problem:
                    say(f"warning: {problem}; fetching it again")
                sources[name] = here if problem is None else fetch_file(
                    name, expected, data_dir, system_dirs, mirrors, timeout, say, deadline, failures=[problem])
            return sources
    except OSError as exc:
        raise common.UsageError(f"--data-dir {data_dir}: cannot use it ({exc.strerror})") from None
