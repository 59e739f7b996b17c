"""What the job can know before it starts, checked without MindSpore in a fraction of a second: the settings,
the output directory (usable, and held by no other job), the data directory, and the settings against the
data when the data is already there. run.sh runs it before msrun starts anything:

    python -m fmnist.preflight WORLD_SIZE [main.py flags...]

It prints the output directory, or one line saying what is wrong and exits 2. main.py checks the same
things on every rank, so a job started by msrun directly is held to them too.
"""

import os
import sys
from pathlib import Path

from . import common, fetch, settings


def usable_dir(path, flag):
    """UsageError unless `path` is a directory this process may write in, or can create as one."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:  # the nearest ancestor that exists decides
        existing = existing.parent
    if not existing.is_dir():
        raise common.UsageError(f"{flag} {path}: {existing} is not a directory; give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise common.UsageError(f"{flag} {path}: {existing} is not writable by this user (uid {os.getuid()}); "
                                "give a directory it may write in")


def data_counts(data_dir, checksums):
    """(training images, test images), read from the label files when all four files are in `data_dir`, or
    None when one is missing or a label file is malformed: the job fetches it then, and checks the counts
    itself. Verifying the checksums is left to the job, which does it anyway, so that start-up hashes the
    data once, not twice."""
    if not all(fetch.local_copy(data_dir, name) for name in checksums):
        return None
    try:
        return tuple(len(fetch.parse_idx(fetch.local_copy(data_dir, f"{split}-labels-idx1-ubyte").read_bytes()))
                     for split in ("train", "t10k"))
    except (OSError, ValueError):
        return None


def check(argv, world_size):
    """The checked settings, after every check that needs no MindSpore and no download; UsageError."""
    cfg = settings.parse_config(argv)
    checksums = fetch.load_checksums(cfg.checksums_file)
    if cfg.loss_scale == "dynamic":  # the one setting the device decides on, so the one check that needs MindSpore
        from . import distributed  # pylint: disable=import-outside-toplevel
        target = distributed.resolve_device(cfg.device)
        settings.resolve_loss_scale(cfg.loss_scale, settings.resolve_amp(cfg.amp, target), target)
    usable_dir(cfg.output_dir, "--output-dir")
    lock = cfg.output_dir / ".lock"
    if lock.exists() and os.environ.get("NODE_RANK", "0") == "0":  # only node 0's job holds it
        common.hold_lock(lock, f"--output-dir {cfg.output_dir}", probe=True).close()
    counts = data_counts(cfg.data_dir, checksums)
    if counts is None:
        usable_dir(cfg.data_dir, "--data-dir")  # the job will write what it fetches there
    else:
        settings.check_against_data(cfg, world_size, *counts)
    return cfg


def main(argv):
    try:
        if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
            raise common.UsageError("usage: python -m fmnist.preflight WORLD_SIZE [main.py flags...]")
        cfg = check(argv[1:], int(argv[0]))
    except common.UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    print(cfg.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
