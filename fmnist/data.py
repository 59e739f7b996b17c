"""The dataset, a seam to replace for your own training (model.py is the other): its files and their sources,
the classes, the splits (uint8 images [N, H, W(, C)], integer labels) and the network's input made from them
(to_model_input, for training and serving alike). No MindSpore at import: run.sh's check loads the splits."""

import dataclasses
from pathlib import Path

import numpy as np

from . import common, fetch

NAME = "fashion-mnist"
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IMAGE_SIZE = 28
# The IDX files of each split, images then labels, as the official release names them.
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
# SHA-256 of the official release's IDX files, decompressed: re-compressed copies (Debian's) match too.
CHECKSUMS = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
PACKAGE, SYSTEM_DIRS = "dataset-fashion-mnist", ("/usr/share/datasets/fashion-mnist",)  # Debian's, Ubuntu's


def load_checksums(path):
    """The expected SHA-256 of each file: the pinned official ones, or those of a sha256sum-style file."""
    if not path:
        return dict(CHECKSUMS)
    try:
        lines = Path(path).read_text().split("\n")
    except OSError as exc:
        raise common.UsageError(f"--checksums-file {path}: cannot read it ({exc.strerror})") from None
    sums = {name.strip().lstrip("*").removesuffix(".gz"): digest.lower()
            for digest, _, name in (line.strip().partition(" ") for line in lines if line.strip())}
    if missing := sorted(set(CHECKSUMS) - set(sums)):
        raise common.UsageError(f"--checksums-file {path}: no checksum for {', '.join(missing)}; "
                                "write one line '<sha256>  <file name>' per IDX file")
    return sums


def make_available(cfg, checksums, say):
    """The verified files in cfg.data_dir (no request when they are there); {file: where it came from}."""
    mirrors = tuple(url.strip() for url in cfg.data_mirrors.split(",") if url.strip())
    sources = fetch.Sources(mirrors, SYSTEM_DIRS, PACKAGE, cfg.download_timeout, cfg.download_deadline, say)
    return fetch.ensure_data(cfg.data_dir, checksums, sources)


@dataclasses.dataclass(frozen=True)
class Split:
    images: np.ndarray  # uint8 [N, H, W] or [N, H, W, C]
    labels: np.ndarray  # integer class indices [N]


@dataclasses.dataclass(frozen=True)
class Splits:
    train: Split
    test: Split


def load_splits(data_dir, checksums=None):
    """The splits, each file's content checked against its checksum as it is read when `checksums` are given;
    UsageError if a file is missing, malformed or different."""
    return Splits(load_split(data_dir, "train", checksums), load_split(data_dir, "test", checksums))


def load_verified(data_dir, checksums):
    """The splits if every file is in data_dir and verifies, else None: the job then fetches them."""
    try:
        return load_splits(data_dir, checksums)
    except common.UsageError:
        return None


def load_split(data_dir, split, checksums):
    paths = {name: fetch.local_copy(data_dir, name) or Path(data_dir, name) for name in FILES[split]}
    try:
        images, labels = (fetch.parse_idx(path.read_bytes(), path.name, checksums and checksums[name])
                          for name, path in paths.items())
    except (OSError, ValueError) as exc:
        raise common.UsageError(f"--data-dir {data_dir}: cannot read the {split} split ({exc})") from None
    if len(images) != len(labels):
        raise common.UsageError(f"{data_dir}: {split} has {len(images)} images but {len(labels)} labels")
    return Split(images, labels)


def to_model_input(images):
    """The article's transforms (resize to 28x28, rescale by 1/255, HWC -> CHW) as float32 [N, C, 28, 28],
    on a whole batch at once (a request to the served model, or one the training draws): numpy's
    vectorised ops, where a per-sample map would call Python for each image."""
    if images.ndim == 3:
        images = images[..., None]
    if images.shape[1:3] != (IMAGE_SIZE, IMAGE_SIZE):
        # Imported here, for other sizes only: run.sh's check imports this module without MindSpore.
        from mindspore.dataset import vision
        resize = vision.Resize((IMAGE_SIZE, IMAGE_SIZE))
        images = np.stack([resize(image) for image in images])
        images = images.reshape(len(images), IMAGE_SIZE, IMAGE_SIZE, -1)
    model_input = np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32)
    # In place: one float32 copy of the batch, not two.
    model_input *= np.float32(1 / 255)
    return model_input


def one_hot(labels):
    return np.eye(len(CLASS_NAMES), dtype=np.float32)[labels]
