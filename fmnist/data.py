"""The dataset, one of the two seams to replace for your own training (model.py is the other): the classes,
the splits as uint8 images [N, H, W(, C)] and integer labels, the network's input made from them
(to_model_input, for training and serving alike), and each rank's shard of every epoch as Model.fit reads it."""

import copy
import dataclasses

import numpy as np

import mindspore as ms

from . import common, fetch
from .fetch import load_checksums  # noqa: F401 (the expected SHA-256 of each file: part of the seam)

CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IMAGE_SIZE = 28


def make_available(cfg, checksums, say):
    """The four verified IDX files in cfg.data_dir (no request when they are there); {file: where it came from}."""
    mirrors = [url.strip() for url in cfg.data_mirrors.split(",") if url.strip()]
    return fetch.ensure_data(cfg.data_dir, checksums, mirrors, cfg.download_timeout, say=say,
                             deadline=cfg.download_deadline)


@dataclasses.dataclass(frozen=True)
class Split:
    images: np.ndarray  # uint8 [N, H, W] or [N, H, W, C]
    labels: np.ndarray  # integer class indices [N]


@dataclasses.dataclass(frozen=True)
class Splits:
    train: Split
    test: Split


def load_splits(data_dir):
    return Splits(*(load_split(data_dir, split) for split in ("train", "t10k")))


def load_split(data_dir, split):
    try:
        images, labels = (fetch.parse_idx(fetch.local_copy(data_dir, f"{split}-{kind}").read_bytes(), kind)
                          for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))
    except (OSError, ValueError) as exc:
        raise common.UsageError(f"--data-dir {data_dir}: cannot read the {split} split ({exc})") from None
    if len(images) != len(labels):
        raise common.UsageError(f"{data_dir}: {split} has {len(images)} images but {len(labels)} labels")
    return Split(images, labels)


def to_model_input(images):
    """The article's transforms (resize to 28x28, rescale by 1/255, HWC -> CHW) as float32 [N, C, 28, 28], once
    for the whole array: Fashion-MNIST fits in memory, and this beats a per-sample map each epoch."""
    if images.ndim == 3:
        images = images[..., None]
    if images.shape[1:3] != (IMAGE_SIZE, IMAGE_SIZE):
        resize = ms.dataset.vision.Resize((IMAGE_SIZE, IMAGE_SIZE))
        images = np.stack([resize(image) for image in images]).reshape(len(images), IMAGE_SIZE, IMAGE_SIZE, -1)
    model_input = np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32)
    model_input *= np.float32(1 / 255)  # in place: the training set's float32 copy is 188 MB
    return model_input


def one_hot(labels, num_classes=len(CLASS_NAMES)):
    return np.eye(num_classes, dtype=np.float32)[labels]


class ShardBatches:
    """This rank's share of every epoch in whole batches: rank r takes the r-th block of the permutation of (seed,
    epoch): shards are disjoint, and a job resumed `skip` steps into `epoch` trains what an unbroken one would."""

    def __init__(self, images, labels, batch_size, rank, world_size, seed, epoch=0, skip=0):
        self.images, self.labels = images, labels
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.epoch, self.skip = epoch, skip

    @property
    def steps_per_epoch(self):
        return len(self.images) // (self.batch_size * self.world_size)

    def __len__(self):
        return self.steps_per_epoch - self.skip

    def __iter__(self):
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.images))
        self.epoch += 1
        per_rank = self.steps_per_epoch * self.batch_size
        mine = order[self.rank * per_rank:(self.rank + 1) * per_rank]
        for start in range(self.skip * self.batch_size, per_rank, self.batch_size):
            batch = mine[start:start + self.batch_size]
            yield self.images[batch], self.labels[batch]


def shard(splits, batch_size, rank, world_size, seed):
    """This rank's disjoint share of every training epoch, and its test samples, every world_size-th from `rank` on
    (the framework's sampler pads shards to equal length by repeating samples, which would count some twice)."""
    shards = ShardBatches(to_model_input(splits.train.images), one_hot(splits.train.labels), batch_size, rank,
                          world_size, seed)
    mine = slice(rank, None, world_size)
    images, labels = to_model_input(splits.test.images[mine]), one_hot(splits.test.labels[mine])
    batches = [(images[i:i + batch_size], labels[i:i + batch_size]) for i in range(0, len(images), batch_size)]
    return shards, ms.dataset.GeneratorDataset(batches, column_names=["image", "label"], shuffle=False,
                                               python_multiprocessing=False)


def train_dataset(shards, epoch=0, skip=0):
    """The training batches for Model.fit from epoch `epoch` (from 0), `skip` steps into it: with `skip`, for the
    rest of one interrupted epoch only (MindSpore fixes a dataset's length for all its epochs)."""
    shards = copy.copy(shards)  # each dataset counts its own epochs
    shards.epoch, shards.skip = epoch, skip
    return ms.dataset.GeneratorDataset(shards, column_names=["image", "label"], shuffle=False,
                                       python_multiprocessing=False)
