"""Getting the data: local copies, the system copy, and downloads from a real HTTP server on 127.0.0.1."""

import gzip
import hashlib
import re
import subprocess
import sys
import time

import pytest

from fmnist import common, data, fetch
from conftest import ROOT, serve, write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """The tiny dataset's gz files and checksums, served by a Mirror for the module's tests."""
    source = tmp_path_factory.mktemp("mirror-files")
    raw = write_dataset(source)
    checksums = {name: hashlib.sha256(content).hexdigest() for name, content in raw.items()}
    files = {p.name: p.read_bytes() for p in source.glob("*.gz")}
    return source, checksums, files


@pytest.fixture
def mirror(dataset):
    with serve(dataset[2]) as server:
        yield server


def fetch_all(data_dir, checksums, mirrors, timeout=5.0, system_dirs=(), say=lambda _: None):
    return fetch.ensure_data(data_dir, checksums,
                             fetch.Sources(tuple(mirrors), system_dirs, data.PACKAGE, timeout, say=say))


def data_files(data_dir):
    """Every file in the data dir but the lock: what a later run could find."""
    return sorted(p.name for p in data_dir.iterdir() if p.name != ".lock")


def assert_all_verified(data_dir, checksums):
    assert data_files(data_dir) == sorted(checksums)  # decompressed
    for name, expected in checksums.items():
        fetch.parse_idx((data_dir / name).read_bytes(), name, expected)


def test_clean_download_then_no_request_on_rerun(tmp_path, dataset, mirror):
    _, checksums, _ = dataset
    fetch_all(tmp_path, checksums, [f"{mirror.url}/good"])
    assert_all_verified(tmp_path, checksums)
    assert mirror.total("good") == 4
    fetch_all(tmp_path, checksums, [f"{mirror.url}/good"])
    assert mirror.total("good") == 4  # the second run made no request at all


@pytest.mark.parametrize("behaviour, message", [
    ("corrupt", "SHA-256 of the content is"),
    ("truncated", "corrupt or truncated gzip"),
    ("html", "magic number"),
    ("cut", "connection closed after"),
])
def test_bad_download_is_an_error_and_leaves_nothing(tmp_path, dataset, mirror, behaviour, message):
    _, checksums, _ = dataset
    with pytest.raises(common.UsageError, match=message) as error:
        fetch_all(tmp_path, checksums, [f"{mirror.url}/{behaviour}"])
    text = str(error.value)
    assert "train-images-idx3-ubyte" in text and f"{mirror.url}/{behaviour}" in text
    assert "--data-dir" in text and "dataset-fashion-mnist" in text  # says how to provide the data
    assert data_files(tmp_path) == []


def test_checksum_error_names_expected_and_actual(tmp_path, dataset, mirror):
    _, checksums, files = dataset
    with pytest.raises(common.UsageError) as error:
        fetch_all(tmp_path, checksums, [f"{mirror.url}/corrupt"])
    corrupt = gzip.decompress(files["train-images-idx3-ubyte.gz"])[:-1] + b"\x01"
    assert checksums["train-images-idx3-ubyte"] in str(error.value)
    assert hashlib.sha256(corrupt).hexdigest() in str(error.value)


def test_hanging_server_times_out_in_bounded_time(tmp_path, dataset, mirror):
    _, checksums, _ = dataset
    started = time.monotonic()
    with pytest.raises(common.UsageError, match=r"timed out.*after 3 attempts"):
        fetch_all(tmp_path, checksums, [f"{mirror.url}/hang"], timeout=0.5)
    assert time.monotonic() - started < 15  # 3 attempts of 0.5 s plus 1 s and 2 s of backoff
    assert mirror.total("hang") == fetch.DOWNLOAD_RETRIES
    assert data_files(tmp_path) == []


def test_404_on_first_mirror_falls_through_to_second(tmp_path, dataset, mirror):
    _, checksums, _ = dataset
    fetch_all(tmp_path, checksums, [f"{mirror.url}/missing", f"{mirror.url}/good"])
    assert_all_verified(tmp_path, checksums)
    assert mirror.total("missing") == 4  # one request per file: a 404 is not retried
    assert mirror.total("good") == 4


def test_interrupted_download_then_successful_rerun(tmp_path, dataset, mirror):
    _, checksums, _ = dataset
    with pytest.raises(common.UsageError):
        fetch_all(tmp_path, checksums, [f"{mirror.url}/cut"])
    assert data_files(tmp_path) == []  # no partial file for the rerun to trust
    fetch_all(tmp_path, checksums, [f"{mirror.url}/good"])
    assert_all_verified(tmp_path, checksums)


def test_corrupt_local_file_is_replaced_by_a_verified_download(tmp_path, dataset, mirror):
    _, checksums, _ = dataset
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01garbage")
    fetch_all(tmp_path, checksums, [f"{mirror.url}/good"])
    assert_all_verified(tmp_path, checksums)


def test_system_copy_is_used_without_any_request(tmp_path, dataset, mirror):
    _, checksums, files = dataset
    system_dir = tmp_path / "system"
    system_dir.mkdir()
    for name, body in files.items():  # decompressed, as another packaging might ship them
        (system_dir / name.removesuffix(".gz")).write_bytes(gzip.decompress(body))
    data_dir = tmp_path / "data"
    fetch_all(data_dir, checksums, [f"{mirror.url}/good"], system_dirs=[str(system_dir)])
    assert sum(mirror.requests.values()) == 0
    assert data_files(data_dir) == sorted(checksums)


def test_offline_error_lists_every_source(tmp_path, dataset):
    _, checksums, _ = dataset
    with pytest.raises(common.UsageError) as error:
        fetch_all(tmp_path / "data", checksums, [], system_dirs=[str(tmp_path / "nowhere")])
    text = str(error.value)
    assert "no source has it" in text and str(tmp_path / "nowhere") in text and str(tmp_path / "data") in text


def test_size_cap_stops_an_oversized_download(tmp_path, dataset, mirror, monkeypatch):
    _, checksums, _ = dataset
    monkeypatch.setattr(fetch, "DOWNLOAD_MAX_BYTES", 100)
    with pytest.raises(common.UsageError, match="byte cap"):
        fetch_all(tmp_path, checksums, [f"{mirror.url}/good"])
    assert data_files(tmp_path) == []


def test_a_slow_download_reports_its_bytes_rate_and_time_left(monkeypatch, mirror):
    monkeypatch.setattr(fetch, "PROGRESS_S", 0.5)
    body = gzip.compress(bytes(range(256)) * (1 << 12), compresslevel=0)  # 1 MiB at 320 KiB/s: about 3 s
    mirror.files["big.gz"] = body
    lines = []
    assert fetch.download(f"{mirror.url}/steady/big.gz", fetch.Sources(timeout=5.0, say=lines.append)) == body
    assert len(lines) >= 3, lines  # one line per interval, not one per chunk
    pattern = r"downloading \S+/big\.gz: (\d+\.\d) of 1\.0 MiB, 0\.\d\d MiB/s, (\d+) s left"
    progress = [re.fullmatch(pattern, line) for line in lines]
    assert all(progress), lines
    assert [float(m.group(1)) for m in progress] == sorted(float(m.group(1)) for m in progress)
    assert int(progress[0].group(2)) >= int(progress[-1].group(2))


def test_two_jobs_sharing_a_data_dir_fetch_once(tmp_path, dataset, mirror):
    """The second job starts while the first is fetching (a second per file) and holds the data dir's lock."""
    _, checksums, _ = dataset
    code = ("import sys; from fmnist import fetch; fetch.ensure_data(sys.argv[1], "
            "dict(a.split('=') for a in sys.argv[3:]), fetch.Sources((sys.argv[2],), timeout=5.0))")
    command = [sys.executable, "-c", code, str(tmp_path), f"{mirror.url}/slow",
               *(f"{name}={digest}" for name, digest in checksums.items())]
    first = subprocess.Popen(command, cwd=ROOT)
    deadline = time.monotonic() + 60
    while not mirror.total("slow") and time.monotonic() < deadline:  # the first holds the lock from here on
        time.sleep(0.01)
    assert first.poll() is None  # the two overlap: the first has three files and a second of this one to go
    second, second_started = subprocess.Popen(command, cwd=ROOT), time.monotonic()
    ended = {}
    while len(ended) < 2 and time.monotonic() < deadline + 60:
        ended.update({job: time.monotonic() for job, process in (("first", first), ("second", second))
                      if job not in ended and process.poll() is not None})
        time.sleep(0.01)
    assert [first.returncode, second.returncode] == [0, 0]
    # It waited on the lock while the first fetched its last files (a second each), then found them verified:
    # no request of its own.
    assert ended["second"] - second_started > 1.5
    assert mirror.total("slow") == 4
    assert_all_verified(tmp_path, checksums)


def test_trickling_mirror_is_abandoned_for_the_next_one(tmp_path, dataset, mirror):
    """One byte every 0.2 s, no Content-Length: each read is in time, the transfer is hopeless."""
    _, checksums, _ = dataset
    lines = []
    started = time.monotonic()
    fetch_all(tmp_path, checksums, [f"{mirror.url}/trickle", f"{mirror.url}/good"],
              timeout=1.0, say=lines.append)
    assert time.monotonic() - started < 20  # about 1 s per file on the trickle, where it would take hours
    assert_all_verified(tmp_path, checksums)
    assert mirror.total("trickle") == 4  # given up at once, not retried
    assert not list(tmp_path.glob(".*.part"))


def test_trickle_alone_fails_with_its_rate_named(tmp_path, dataset, mirror):
    _, checksums, _ = dataset
    with pytest.raises(common.UsageError, match=r"bytes/s after \d+ s, under the minimum of 16,384 bytes/s"):
        fetch_all(tmp_path, checksums, [f"{mirror.url}/trickle"], timeout=1.0)
    assert data_files(tmp_path) == []


def test_too_long_download_is_abandoned_for_the_next_mirror(tmp_path, dataset, mirror):
    """A steady mirror, 16 KiB every 0.05 s, and a deadline of 0.1 s: the image files (over 48 KiB, so a
    fourth chunk comes after 0.15 s) outlast it and come from the next mirror; the label files complete in
    time."""
    _, checksums, files = dataset
    assert min(len(files[f"{split}-images-idx3-ubyte.gz"]) for split in ("train", "t10k")) > 48 << 10
    mirrors = (f"{mirror.url}/steady", f"{mirror.url}/good")
    fetch.ensure_data(tmp_path, checksums, fetch.Sources(mirrors, deadline=0.1, say=lambda _: None))
    assert_all_verified(tmp_path, checksums)
    assert mirror.total("steady") == 4  # each file tried once there, none retried
    # The image files cannot arrive in time; a label file (one chunk) does unless the machine stalls.
    assert {"/good/t10k-images-idx3-ubyte.gz", "/good/train-images-idx3-ubyte.gz"} <= set(mirror.requests)


def test_deadline_ends_a_download_that_is_steady_but_too_long(mirror):
    mirror.files["big.gz"] = bytes(4 << 20)  # 4 MiB at 320 KiB/s: 13 s, over any minimum rate
    started = time.monotonic()
    with pytest.raises(ValueError,
                       match=r"not complete after \d+ s \(\d+ bytes\), over --download-deadline 1.5"):
        fetch.download(f"{mirror.url}/steady/big.gz", fetch.Sources(timeout=5.0, deadline=1.5))
    assert time.monotonic() - started < 10  # 1.5 s and the next chunk, not the 13 s of the whole file
    assert mirror.total("steady") == 1
